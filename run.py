"""tfmemlab entry point: `python run.py precision=mixed accum=4`, `python run.py -m ...`."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.cli import check_command_line
from runner.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # Imported here so that --help, --cfg and bad input answer before TensorFlow loads.
    from runner.train import run

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        run(cfg)
        return
    try:
        run(cfg)
    except Exception as err:  # recorded FAILED (with its `failure` tag): the sweep goes on
        from runner.tracking import failure_kind

        print(
            f"tfmemlab: job {HydraConfig.get().job.num} failed ({failure_kind(err)}): "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    main()
