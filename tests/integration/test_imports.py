import subprocess
import sys


def _modules_after(stmt):
    code = (
        f"import sys, time; t=time.process_time(); {stmt}; print(time.process_time()-t); "  # CPU s: load-proof
        "print(' '.join(m for m in ('megatron', 'sglang', 'transformer_engine', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    secs, heavy = out.splitlines()[0], (out.splitlines()[1:] or [""])[0]
    return float(secs), heavy.split()


def test_import_moe_rl_is_cheap():
    secs, heavy = _modules_after(
        "import moe_rl, moe_rl.config, moe_rl.losses, moe_rl.routing.flip, moe_rl.tasks"
    )
    assert heavy == [], f"import pulled in {heavy}"
    assert secs < 5.0


def test_megatron_is_imported_only_under_moe_rl_megatron():
    from pathlib import Path

    root = Path(__file__).parents[2]
    offenders = []
    for p in list(root.glob("moe_rl/**/*.py")) + list(root.glob("kernels/**/*.py")):
        if "moe_rl/megatron" in p.as_posix():
            continue
        text = p.read_text()
        if "import megatron" in text or "from megatron" in text:
            offenders.append(str(p.relative_to(root)))
    assert offenders == []


def test_the_python_api_is_reachable_from_the_package_and_stays_cheap():
    """``import moe_rl`` gives the notebook API (each name loaded on first use), still without torch;
    so does ``moe_rl.megatron``'s own import (its deferred-compile hook)."""
    import subprocess
    import sys

    code = (
        "import sys, moe_rl, moe_rl.megatron\n"
        "assert 'torch' not in sys.modules\n"
        "r = moe_rl.load_recipe('recipes/tiny.yaml', ['optim.lr=3e-4'])\n"
        "assert isinstance(r, moe_rl.Recipe) and r.optim.lr == 3e-4\n"
        "assert callable(moe_rl.train) and moe_rl.Run.__name__ == 'Run' and 'gspo' in moe_rl.LOSSES\n"
        "print('ok')\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
