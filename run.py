"""tfmemlab entry point: `python run.py precision=mixed accum=4`, `python run.py -m ...`."""

import sys

import hydra
from omegaconf import DictConfig

from runner.cli import check_command_line
from runner.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # Imported here so that --help, --cfg and bad input answer before TensorFlow loads.
    from runner.train import run

    run(cfg)


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    main()
