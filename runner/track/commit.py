"""The code a run ran, as MLflow's source tags: the git commit of tfmemlab's own repository
(not of the folder the command was started from), whether its tree had changes, and the
entry point.

MLflow's UI shows `mlflow.source.name` and `mlflow.source.git.commit` as the run's Source; the
fluent API sets them from the cwd's repository, which tfmemlab's explicit client does not use.
`git_dirty` says whether that commit is the whole story: `true` when tracked files differ from
it or files git does not ignore were added. No git, or code outside a repository: the tag
`git` says why, and nothing fails.
"""

import subprocess
import sys
from pathlib import Path

from runner.core.secrets import redact

CODE = Path(__file__).resolve().parents[2]  # the folder holding runner/ and models/


def _git(*args: str, cwd: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.strip()


def _entry_point(repo: Path) -> str:
    """The script that was started (run.py), relative to the repository when it is in it."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is not None and script.is_file():
        return str(script.relative_to(repo)) if script.is_relative_to(repo) else str(script)
    return "runner.train.pipeline.run"


def source_tags(code: Path = CODE) -> dict[str, str]:
    """mlflow.source.* tags and git_dirty for the repository holding `code`; without one,
    git_dirty=unknown and a `git` tag saying why."""
    try:
        repo = Path(_git("rev-parse", "--show-toplevel", cwd=code))
        commit = _git("rev-parse", "HEAD", cwd=repo)
        changed = _git("status", "--porcelain", cwd=repo)
    except FileNotFoundError:
        return {"mlflow.source.type": "LOCAL", "git_dirty": "unknown", "git": "no git installed"}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        why = (getattr(err, "stderr", "") or str(err)).strip().splitlines()
        reason = why[0] if why else str(err)
        return {
            "mlflow.source.type": "LOCAL",
            "mlflow.source.name": _entry_point(code),
            "git_dirty": "unknown",
            "git": f"no commit: {code}: {reason}"[:500],
        }
    tags = {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": _entry_point(repo),
        "mlflow.source.git.commit": commit,
        "git_dirty": str(bool(changed)).lower(),
    }
    try:
        tags["mlflow.source.git.branch"] = _git("rev-parse", "--abbrev-ref", "HEAD", cwd=repo)
        tags["mlflow.source.git.repoURL"] = redact(_git("remote", "get-url", "origin", cwd=repo))
    except subprocess.CalledProcessError:  # no remote: the commit is what identifies the code
        pass
    return tags
