"""vLLM's CPU set-up (tcmalloc + Intel OpenMP preloaded): the LD_PRELOAD value, the re-exec, the CLI."""

from __future__ import annotations

import pytest

from vllm_dspark.tools import cli, cpu_setup


class Exec(Exception):
    pass


@pytest.fixture
def libs(tmp_path, monkeypatch):
    tc, iomp = tmp_path / "libtcmalloc_minimal.so.4", tmp_path / "libiomp5.so"
    found = {"tcmalloc": str(tc), "iomp": str(iomp)}
    monkeypatch.setattr(cpu_setup, "find_libs", lambda: dict(found))
    monkeypatch.setattr(cpu_setup, "gpu_host", lambda: False)
    calls = []

    def execve(path, argv, env):
        calls.append(env)
        raise Exec

    monkeypatch.setattr(cpu_setup.os, "execve", execve)
    monkeypatch.delenv(cpu_setup._MARK, raising=False)
    # Importing vLLM's CPU platform adds torch's libgomp to this process's LD_PRELOAD: start clean,
    # whatever ran before in this session.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    return found, calls


def test_preload_puts_both_libraries_first_and_keeps_the_rest_once(libs, monkeypatch):
    found, _ = libs
    monkeypatch.setenv("LD_PRELOAD", f"/x/libother.so:{found['iomp']}")
    value, missing = cpu_setup.preload_value()
    assert missing == []
    assert value.split(":") == [found["tcmalloc"], found["iomp"], "/x/libother.so"]


def test_a_missing_library_is_named_with_its_fix(libs, capsys):
    found, _ = libs
    found["tcmalloc"] = None
    value, missing = cpu_setup.preload_value()
    assert value == found["iomp"] and missing == ["tcmalloc (apt-get install libtcmalloc-minimal4)"]
    assert cli.main(["cpu-preload"]) == 1
    assert "apt-get install libtcmalloc-minimal4" in capsys.readouterr().err


def test_cli_prints_the_value(libs, capsys, monkeypatch):
    found, _ = libs
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert cli.main(["cpu-preload"]) == 0
    assert capsys.readouterr().out.strip() == f"{found['tcmalloc']}:{found['iomp']}"


def test_reexec_sets_the_preloads_once(libs, monkeypatch):
    found, calls = libs
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    with pytest.raises(Exec):
        cpu_setup.reexec_with(True, log=lambda m: None)
    env = calls[-1]
    assert env["LD_PRELOAD"] == f"{found['tcmalloc']}:{found['iomp']}:/x/libother.so"
    assert env[cpu_setup._MARK] == "1"
    monkeypatch.setenv(cpu_setup._MARK, "1")  # the restarted process does not restart again
    cpu_setup.reexec_with(True)
    assert len(calls) == 1


def test_reexec_without_strips_them(libs, monkeypatch):
    found, calls = libs
    monkeypatch.setenv("LD_PRELOAD", f"{found['tcmalloc']}:/x/libother.so:{found['iomp']}")
    with pytest.raises(Exec):
        cpu_setup.reexec_with(False)
    assert calls[-1]["LD_PRELOAD"] == "/x/libother.so" and calls[-1][cpu_setup._MARK] == "0"


def test_a_gpu_host_is_left_alone(libs, monkeypatch):
    _, calls = libs
    monkeypatch.setattr(cpu_setup, "gpu_host", lambda: True)
    cpu_setup.reexec_with(True)
    assert calls == []

