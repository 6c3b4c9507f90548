"""The README's Python blocks run as written, in order, in one fresh interpreter (step times on a datasheet
profile unless SNN_EXPLORER_HARDWARE says otherwise, so that the Explorer block does not calibrate this machine)."""
import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "README.md")


def python_blocks(text: str) -> list:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.timeout(400)
def test_readme_python_blocks_run_as_written(tmp_path):
    blocks = python_blocks(open(README).read())
    assert len(blocks) >= 2, "the README's examples are ```python blocks"
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join(blocks) + "\nprint('README OK')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=380,
                          env={**os.environ, "MPLBACKEND": "Agg", "SNN_EXPLORER_PROGRESS": "0",
                               "SNN_EXPLORER_HARDWARE": os.environ.get("SNN_EXPLORER_HARDWARE", "A100-SXM-80GB")})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("README OK")
