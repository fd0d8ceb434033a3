"""Packages carried to the GPU machine as wheels in ``.whl/`` (``bench/fetch_gpu_wheels.sh``),
installed by ``bench/gpu_check.py`` without a network into a private folder that every step
has on its path: checked on the CPU with tiny wheels built here (a wheel is a zip with a
``.dist-info`` folder). A wheel lands in the folder and imports from a child process; an
empty or missing ``.whl`` installs nothing and says so; a broken wheel, a wheel for another
interpreter or an unreadable folder is recorded and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str], tag: str = "py3-none-any") -> Path:
    """A wheel of ``files`` (paths inside the wheel) with its ``.dist-info`` (METADATA, WHEEL, RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for inner, text in files.items():
            zf.writestr(inner, text)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def child_python(code: str, path: Path) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter with ``path`` first on PYTHONPATH (and nothing else of ours)."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_a_wheel_lands_in_the_target_folder_and_imports_from_a_child_process(tmp_path):
    wheels = tmp_path / "whl"
    make_wheel(wheels, "tinycarried", "1.2", {
        "tinycarried/__init__.py": "VALUE = 42\n",
        "tinycarried-1.2.data/purelib/tinycarried_extra.py": "EXTRA = 'from .data/purelib'\n",
        "tinycarried-1.2.data/scripts/tool": "#!/bin/sh\n",  # not an importable scheme: left out
    })  # fmt: skip
    target = tmp_path / "site"
    record = gpu_check.install_carried_wheels(wheels, target)
    assert record["status"] == "installed" and record["installed"] == {"tinycarried": "1.2"}
    assert (record["failed"], record["skipped"]) == ([], [])
    assert sorted(p.name for p in target.iterdir()) == ["tinycarried", "tinycarried-1.2.dist-info", "tinycarried_extra.py"]
    code = ("import importlib.metadata as m, tinycarried, tinycarried_extra; print(tinycarried.VALUE, "
            "tinycarried_extra.EXTRA, m.version('tinycarried'), tinycarried.__file__, sep='|')")  # fmt: skip
    proc = child_python(code, target)
    assert proc.returncode == 0, proc.stderr
    value, extra, version, where = proc.stdout.strip().split("|")
    assert (value, extra, version) == ("42", "from .data/purelib", "1.2")
    assert where.startswith(str(target))
    assert child_python("import tinycarried", tmp_path).returncode != 0  # only the target folder holds it


@pytest.mark.parametrize("made", [False, True])
def test_a_missing_or_empty_wheel_folder_installs_nothing_and_says_so(tmp_path, made):
    wheels = tmp_path / ".whl"
    if made:
        wheels.mkdir()
        (wheels / "README").write_text("not a wheel")
    record = gpu_check.install_carried_wheels(wheels, tmp_path / "site")
    assert record["status"] == "none" and record["installed"] == {}
    assert record["note"] == f"no wheels in {wheels}"
    assert not (tmp_path / "site").exists()


def test_a_broken_wheel_is_recorded_and_the_others_still_install(tmp_path):
    wheels = tmp_path / "whl"
    make_wheel(wheels, "good", "1.0", {"good.py": "OK = True\n"})
    (wheels / "notazip-1.0-py3-none-any.whl").write_bytes(b"this is not a zip file")
    with zipfile.ZipFile(wheels / "noinfo-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("noinfo.py", "")  # no .dist-info folder
    make_wheel(wheels, "escapes", "1.0", {"../outside.py": "BAD = True\n"})  # a member outside the target
    target = tmp_path / "site"
    record = gpu_check.install_carried_wheels(wheels, target)
    assert record["status"] == "partial" and record["installed"] == {"good": "1.0"}
    failed = {entry["wheel"]: entry["error"] for entry in record["failed"]}
    assert set(failed) == {"notazip-1.0-py3-none-any.whl", "noinfo-1.0-py3-none-any.whl", "escapes-1.0-py3-none-any.whl"}
    assert "BadZipFile" in failed["notazip-1.0-py3-none-any.whl"]
    assert "no .dist-info" in failed["noinfo-1.0-py3-none-any.whl"]
    assert "'../outside.py'" in failed["escapes-1.0-py3-none-any.whl"]
    assert not (tmp_path / "outside.py").exists()
    assert sorted(p.name for p in target.iterdir()) == ["good-1.0.dist-info", "good.py"]  # nothing of the broken ones


def test_a_wheel_for_another_interpreter_is_skipped_with_its_reason(tmp_path):
    wheels = tmp_path / "whl"
    make_wheel(wheels, "other", "1.0", {"other.py": ""}, tag="cp27-cp27m-manylinux1_x86_64")
    make_wheel(wheels, "other", "0.9", {"other.py": ""})  # a second wheel of a package already installed
    make_wheel(wheels, "other", "1.1", {"other.py": ""})
    record = gpu_check.install_carried_wheels(wheels, tmp_path / "site")
    assert record["installed"] == {"other": "0.9"} and record["status"] == "partial"
    reasons = {entry["wheel"]: entry["reason"] for entry in record["skipped"]}
    assert reasons["other-1.0-cp27-cp27m-manylinux1_x86_64.whl"].startswith("not for this interpreter")
    assert reasons["other-1.1-py3-none-any.whl"] == "another wheel of other (0.9) is installed"


def test_a_wheel_folder_that_is_a_file_is_a_value_error_naming_it(tmp_path):
    not_a_folder = tmp_path / ".whl"
    not_a_folder.write_text("")
    with pytest.raises(ValueError, match=r"\.whl"):
        gpu_check.install_carried_wheels(not_a_folder, tmp_path / "site")


def test_every_step_sees_the_carried_packages_and_the_summary_names_them(tmp_path):
    wheels = tmp_path / "whl"
    make_wheel(wheels, "tinycarried", "2.0", {"tinycarried.py": "VALUE = 'carried'\n"})
    steps = (gpu_check.Step("first", 10, ""), gpu_check.Step("second", 10, ""))

    def command(step, python, work, dry_run, quick):
        return [python, "-c", f"import tinycarried; print('{step.name}', tinycarried.VALUE)"]

    out = tmp_path / "out"
    summary = gpu_check.run_check(out, dry_run=True, quick=False, steps=steps, total_s=20, command=command, wheel_dir=wheels)
    assert summary["passed"] is True, summary["steps"]
    carried = summary["carried_packages"]
    assert carried["status"] == "installed" and carried["installed"] == {"tinycarried": "2.0"}
    log = (out / gpu_check.LOG).read_text()
    assert "== carried packages ==" in log and "installed tinycarried 2.0" in log
    assert "first carried" in log and "second carried" in log
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "gpu_summary.json"]  # the folder is a temporary one
    assert json.loads((out / gpu_check.SUMMARY).read_text())["carried_packages"] == carried


def test_without_wheels_the_steps_run_as_before_and_the_summary_says_none(tmp_path):
    steps = (gpu_check.Step("only", 10, ""),)

    def command(step, python, work, dry_run, quick):
        return [python, "-c", "import importlib.util as u; raise SystemExit(u.find_spec('tinycarried') is not None)"]

    summary = gpu_check.run_check(tmp_path, dry_run=True, quick=False, steps=steps, total_s=20, command=command,
                                  wheel_dir=tmp_path / "absent")  # fmt: skip
    assert summary["passed"] is True
    assert summary["carried_packages"]["status"] == "none"
    assert f"no wheels in {tmp_path / 'absent'}" in (tmp_path / gpu_check.LOG).read_text()


def test_an_install_that_raises_is_logged_and_the_run_goes_on(tmp_path):
    not_a_folder = tmp_path / "whl"
    not_a_folder.write_text("")
    steps = (gpu_check.Step("only", 10, ""),)

    def command(step, python, work, dry_run, quick):
        return [python, "-c", "print('ran')"]

    summary = gpu_check.run_check(tmp_path / "out", dry_run=True, quick=False, steps=steps, total_s=20,
                                  command=command, wheel_dir=not_a_folder)  # fmt: skip
    assert summary["passed"] is True and summary["steps"][0]["status"] == "passed"
    carried = summary["carried_packages"]
    assert carried["status"] == "failed" and carried["installed"] == {}
    assert carried["note"].startswith("ValueError:") and str(not_a_folder) in carried["note"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_gpu_run_and_the_dry_run_carry_the_same_wheel_folder(monkeypatch, tmp_path, dry_run):
    seen = {}

    def fake_run_check(out_dir, dry_run, quick, **kwargs):
        seen.update(kwargs)
        return {"steps": [], "wall_s": 0.0, "passed": True}

    monkeypatch.setattr(gpu_check, "run_check", fake_run_check)
    monkeypatch.setattr(gpu_check, "_has_cuda", lambda: True)
    argv = ["--out", str(tmp_path)] + (["--dry-run"] if dry_run else [])
    assert gpu_check.main(argv) == 0
    assert seen["wheel_dir"] == gpu_check.ROOT / ".whl"
    assert gpu_check.main([*argv, "--wheels", str(tmp_path / "w")]) == 0
    assert seen["wheel_dir"] == (tmp_path / "w").resolve()
