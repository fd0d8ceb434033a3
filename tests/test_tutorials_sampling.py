"""The sampling tutorials run and print the documents' results."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, str(ROOT / "tutorials" / name)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tutorial_03_logits_processors():
    out = run("03_logits_processors.py")
    assert "after:  biases = {1: {100: 0.5}, 0: {200: -0.3}}" in out  # N.3 swap
    assert "after:  biases = {2: {300: 0.8}, 1: {100: 0.5}}" in out  # N.4 one-way move
    assert "rows = [0, 0, 2]  tokens = [100, 200, 50]  bias = [0.5, -0.3, 1.0]" in out  # S2
    assert "count = 3  non-zero rows = 3" in out  # R2, no drift
    assert "pop_removed x3 = [3, 5, 7]" in out  # U2


def test_tutorial_04_thinking_budget():
    out = run("04_thinking_budget.py")
    assert "budget=10 think_count=8 spec_len=3 -> force_index=[2]" in out
    assert "output = [1, 7, 7, 7, 2, 3, 7, 7, 7]" in out
    assert "-> token 2 (forced)" in out and "-> token 3 (forced)" in out
    assert "force_index = [2]; forced rows = [[2, 2]]" in out
