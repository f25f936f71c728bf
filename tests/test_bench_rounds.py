"""bench/rounds.py's helpers that decide what a timed new process measures."""

from bench.rounds import new_process_env


def test_a_timed_new_process_writes_bytecode_as_a_users_install_does(monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = new_process_env(ACCELRUN_CACHE_DIR="/tmp/cache")
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["ACCELRUN_CACHE_DIR"] == "/tmp/cache" and env["PATH"]
