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

    def unmount():
        # a file a child of the test still holds (megatron-core's checkpoint writer) makes a plain
        # umount fail: detach it lazily then, never leave the mount behind the test
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)

    return unmount
