"""The agent process's script: ``python agent.py RUN_DIR`` (started by :func:`snn_explorer.ranks.run`).

It puts the caller's ``sys.path`` in place, then runs :func:`snn_explorer.ranks.elastic_agent.main`
(torch elastic, forking the ranks).
"""
import json
import os
import sys


def _import_path(spec: dict) -> None:
    """The caller's ``sys.path`` (and this package's root, if the caller found it elsewhere)."""
    sys.path[:] = spec["sys_path"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:
        sys.path.append(root)


def main(run_dir: str) -> int:
    with open(os.path.join(run_dir, "spec.json")) as fh:
        spec = json.load(fh)
    _import_path(spec)
    # lazy: the package is found only on the caller's sys.path, set just above
    from snn_explorer.ranks.elastic_agent import main as run_agent

    return run_agent(run_dir, spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
