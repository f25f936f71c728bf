"""What the launcher prints of its ranks' user errors (the race: rank 1 fails first, the agent
stops rank 0 before it prints)."""

from accelrun.dist.rank_errors import leave_record, unprinted_messages


def test_a_message_no_rank_printed_is_handed_back_once(tmp_path):
    leave_record(tmp_path, 3, ["no file matches none*.txt"], printed=False)
    leave_record(tmp_path, 1, ["no file matches none*.txt"], printed=False)
    assert unprinted_messages(tmp_path) == ["no file matches none*.txt"]


def test_what_rank_0_printed_is_not_printed_again(tmp_path):
    leave_record(tmp_path, 0, ["bad path"], printed=True)
    leave_record(tmp_path, 1, ["bad path", "only rank 1 knows this"], printed=False)
    assert unprinted_messages(tmp_path) == ["only rank 1 knows this"]


def test_no_records_and_torn_files_give_nothing(tmp_path):
    assert unprinted_messages(tmp_path) == []
    (tmp_path / "rank-5.json").write_text('{"rank": 5, "mess')  # never written by leave_record
    assert unprinted_messages(tmp_path) == []
    assert not list(tmp_path.glob(".rank-*"))


def test_a_record_of_an_earlier_start_is_not_this_failures(tmp_path, monkeypatch):
    """Under --max-restarts: rank 1 of the first start stopped on a user error; the restarted rank 1 was
    killed before it left a record of its own. The first start's message is not printed as the job's;
    one of the latest start is, even from a rank that could not record its process (its log failed)."""
    from accelrun.dist.rank_failures import _write

    leave_record(tmp_path, 1, ["no file matches none*.txt"], printed=False)  # start 0
    _write(tmp_path / "proc-0.json", {"rank": 0, "local_rank": 0, "pid": 1, "attempt": 1})
    assert unprinted_messages(tmp_path) == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    leave_record(tmp_path, 1, ["no file matches none*.txt"], printed=False)  # start 1, no process record
    assert unprinted_messages(tmp_path) == ["no file matches none*.txt"]
    # a start after a node rejoined keeps the count: a record of another process of that rank is older
    _write(tmp_path / "proc-1.json", {"rank": 1, "local_rank": 1, "pid": 2, "attempt": 1})
    assert unprinted_messages(tmp_path) == []
    # the newest start recorded no process at all; its rank's old process record is another start's
    _write(tmp_path / "proc-1.json", {"rank": 1, "local_rank": 1, "pid": 2, "attempt": 0})
    _write(tmp_path / "proc-0.json", {"rank": 0, "local_rank": 0, "pid": 1, "attempt": 0})
    assert unprinted_messages(tmp_path) == ["no file matches none*.txt"]
