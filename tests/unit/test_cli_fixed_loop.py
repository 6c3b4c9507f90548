"""A tutorial-style net whose forward loops a fixed ``num_steps`` through the CLI: refused in one line that
names the loop and the fix (exit 2), where it used to end in an IndexError traceback."""
import shutil
import sys
from pathlib import Path

from snn_explorer.cli import main


def test_a_fixed_num_steps_loop_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    shutil.copy(Path(__file__).parent.parent / "fixed_loop_net.py", tmp_path / "fixed_loop_net.py")
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(["compare", "fixed_loop_net:make_net", "--input-shape", "8,8,16", "--world-size", "2"])
    finally:
        sys.modules.pop("fixed_loop_net", None)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "loops a fixed number of steps (for step in range(num_steps))" in err
    assert "for step in range(x.shape[0])" in err and "on the example's 8" in err
