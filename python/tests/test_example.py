# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""examples/python/train_tiny_moe.py runs: a few steps on 2 processes (gloo) and on 1, against
transformers' Mixtral block where transformers is installed; finite, falling loss; plots."""
import json
import math
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
try:
    import epmoe.torch  # noqa: F401
except ImportError as e:
    pytest.skip(f"epmoe.torch not importable ({e}): build build/py and put build/py/python on "
                "PYTHONPATH", allow_module_level=True)
try:
    import transformers  # noqa: F401
    HAS_HF = True
except ImportError:
    HAS_HF = False

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "train_tiny_moe.py")
TIMEOUT = 240  # seconds for the whole run; its collectives give up sooner (--timeout)


def run_example(out, *args, script=EXAMPLE):
    """Runs the example in its own session (so a hang kills it and every process it spawned);
    returns (exit code, stdout + stderr)."""
    cmd = [sys.executable, script] + (["--out", str(out)] if out else []) + ["--timeout", "60",
                                                                              *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {TIMEOUT} s:\n{text[-4000:]}")
    return proc.returncode, text


def check_run(out, text, steps, compare):
    with open(os.path.join(out, "history.json")) as f:
        hist = json.load(f)
    ep = hist["runs"]["epmoe"]
    assert [h["step"] for h in ep] == list(range(steps))
    for h in ep:
        assert math.isfinite(h["loss"]) and math.isfinite(h["aux"]), h
        assert h["aux"] > 0, h  # the balancing loss is part of the objective
        assert len(h["load"]) == 2 and all(sum(row) > 0 for row in h["load"]), h
    assert ep[-1]["loss"] < ep[0]["loss"], [h["loss"] for h in ep]
    for name in ("loss.png", "expert_load.png"):
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    if compare:
        s = hist["summary"]
        assert s["hf_agrees"], s
        assert "agree" in text and len(hist["runs"]["hf"]) == steps


def test_two_processes(tmp_path):
    steps = 8
    args = ["--procs", "2", "--steps", str(steps)] + (["--compare-hf"] if HAS_HF else [])
    rc, text = run_example(tmp_path, *args)
    assert rc == 0, text[-4000:]
    check_run(tmp_path, text, steps, HAS_HF)
    assert "2 processes (gloo)" in text


def test_one_process(tmp_path):
    rc, text = run_example(tmp_path, "--procs", "1", "--steps", "4", "--threads", "1")
    assert rc == 0, text[-4000:]
    check_run(tmp_path, text, 4, False)


def test_mismatch_fails(tmp_path):
    """An impossible tolerance must make the comparison fail with exit code 1."""
    if not HAS_HF:
        pytest.skip("transformers is not installed")
    rc, text = run_example(tmp_path, "--procs", "1", "--steps", "2", "--threads", "1",
                           "--compare-hf", "--hf-rtol", "-1", "--no-plots")
    assert rc == 1, text[-4000:]
    assert "FAIL" in text


GENERATE = os.path.join(ROOT, "examples", "python", "generate_expert_parallel.py")


def test_generate_expert_parallel():
    """examples/python/generate_expert_parallel.py on 2 processes: the tokens equal the
    unmodified model's, each rank holds half the expert bytes."""
    if not HAS_HF:
        pytest.skip("transformers is not installed")
    rc, text = run_example(None, "--procs", "2", script=GENERATE)
    assert rc == 0, text[-4000:]
    assert "tokens equal the unmodified model's: yes" in text, text[-4000:]
    for r in range(2):
        assert f"rank {r}: expert bytes" in text and "(50%)" in text, text[-4000:]


DECODE = os.path.join(ROOT, "examples", "python", "decode_overlap.py")


def test_decode_overlap():
    """examples/python/decode_overlap.py on 2 processes, small: both schedules run and agree."""
    rc, text = run_example(None, "--procs", "2", "--tokens", "1,8", "--layers", "2", "--steps",
                           "2", "--hidden", "64", "--ffn", "96", script=DECODE)
    assert rc == 0, text[-4000:]
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["8"])]
    assert len(rows) == 2 and all(r[-1] == "yes" for r in rows), text[-4000:]
