"""The GPU suite's scripts, checked on the CPU: they parse, every script a step names exists, and the
per-file test runner isolates files (a failing file fails only itself and sets the exit status).
The whole suite runs on the CPU with ``GPU_SUITE_DRY_RUN=1 bash benchmarks/gpu_suite.sh`` (minutes)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
RUNNER = ROOT / "benchmarks" / "gpu_tests.sh"


def test_scripts_parse_and_name_existing_files():
    for script in (SUITE, RUNNER):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    text = SUITE.read_text()
    named = set(re.findall(r"(benchmarks/[\w/]+\.(?:py|sh))", text))
    named |= {f"benchmarks/kernels/{b}.py" for b in re.findall(r"\b(bench_\w+)\b", text)}
    named |= set(re.findall(r"(tests/[\w/]+\.py)", text))
    assert "benchmarks/ar_graph_step.py" in named and "benchmarks/gpu_tests.sh" in named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_per_file_runner_isolates_files(tmp_path):
    # Outside tests/kernels the runner selects the GPU tests (-k gpu): the CPU-only test is deselected.
    (tmp_path / "test_good.py").write_text("def test_gpu_ok():\n    assert 1 + 1 == 2\n\n\n"
                                           "def test_cpu_only():\n    assert False\n")
    (tmp_path / "test_bad.py").write_text("def test_gpu_broken():\n    assert 1 + 1 == 3\n")
    out = tmp_path / "logs"
    files = [str(tmp_path / "test_good.py"), str(tmp_path / "test_bad.py")]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "TEST_JOBS": "2"}
    res = subprocess.run(["bash", str(RUNNER), str(out), "60", *files], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert res.returncode != 0, res.stdout + res.stderr  # one file failed
    summary = (out / "summary.txt").read_text().splitlines()
    by_file = {line.split()[0]: line for line in summary}
    assert " rc=0 " in by_file[files[0]] and "1 passed, 1 deselected" in by_file[files[0]], summary
    assert " rc=1 " in by_file[files[1]] and "1 failed" in by_file[files[1]], summary
    assert (out / "test_bad.log").read_text().count("assert 1 + 1 == 3") >= 1
