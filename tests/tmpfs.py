"""A real file system to fail on (read-only, full) for the tests of what a write does then."""

import pytest


def mount_tmpfs(path, options: str):
    """Mount a tmpfs with ``options`` at ``path`` (a real file system to fail on: read-only, full);
    the test is skipped where mounting is not allowed (not root). Returns the unmount call."""
    import subprocess

    path.mkdir(exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {res.stderr.decode().strip()}")
    return lambda: subprocess.run(["umount", str(path)], check=False)
