"""Figure files name the command that made them, as a user would type it."""

from mmspec.provenance import command_line, stamp


def test_command_line_as_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/venv/bin/mmspec", "bench", "run", "--out", "my runs"])
    assert command_line() == "mmspec bench run --out 'my runs'"
    monkeypatch.setattr("sys.argv", ["/venv/lib/python3.11/site-packages/mmspec/__main__.py", "report", "r"])
    assert command_line() == "mmspec report r"  # python -m mmspec
    monkeypatch.setattr("sys.argv", ["perf/speed.py", "--threads", "1"])  # not the mmspec CLI: as given
    assert command_line() == "perf/speed.py --threads 1"


def test_stamp_has_command_date_and_machine(monkeypatch):
    monkeypatch.setattr("sys.argv", ["mmspec", "train", "evaluate"])
    s = stamp()
    assert s["command"] == "mmspec train evaluate" and s["date"][:2] == "20" and s["date"][-6] in "+-"
    assert s["machine"]["cpu_count"] >= 1 and s["machine"]["device"] == "cpu" and s["machine"]["transformers"]
