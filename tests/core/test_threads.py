"""The ``--threads`` default (:mod:`mmspec.threads`): the cores the machine leaves idle, never more
than this process may use or torch counts, shared among a launcher's local ranks, at least 1; a
count the user set (``--threads``, ``OMP_NUM_THREADS``) is taken as given; and the one line that
says so beside a speed-up."""

from __future__ import annotations

import pytest

from mmspec.threads import apply_threads, default_threads, threads_note, usable_cores


@pytest.mark.parametrize("cores, load, want", [
    (2, 0.0, 2), (2, 0.3, 2),  # a quiet machine: every core
    (2, 1.0, 1), (2, 1.7, 1), (2, 9.0, 1),  # another job on a core: leave it alone, never 0
    (8, 3.2, 5), (8, 3.6, 4),  # rounded: 4.8 idle cores -> 5, 4.4 -> 4
])
def test_the_default_leaves_busy_cores_alone(cores, load, want):
    assert default_threads({}, available=cores, cores=cores, load=load) == want


def test_the_default_is_capped_by_the_cores_this_process_may_use_and_shared_among_ranks():
    assert default_threads({}, available=16, cores=4, load=0.0) == 4  # taskset / a container's share
    assert default_threads({}, available=2, cores=8, load=0.0) == 2  # torch's count (physical cores)
    assert default_threads({"LOCAL_WORLD_SIZE": "2"}, available=8, cores=8, load=2.0) == 3
    assert default_threads({"LOCAL_WORLD_SIZE": "x"}, available=2, cores=2, load=0.0) == 2


def test_omp_num_threads_given_by_the_user_is_not_second_guessed():
    assert default_threads({"OMP_NUM_THREADS": "2"}, available=2, cores=2, load=9.0) == 2


def test_the_note_says_how_many_threads_and_why():
    assert threads_note(3, 3) == "CPU threads: 3 (--threads)"
    note = threads_note(None, 1)
    assert note.startswith(f"CPU threads: 1 of {usable_cores()} core(s) (the default: the cores the machine "
                           "leaves idle, load ") and "--threads N sets it" in note


def test_set_threads_says_it_where_asked(monkeypatch):
    import torch
    from rich.console import Console

    from mmspec.cli import common

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    console = Console(record=True, width=300)
    monkeypatch.setattr(common, "console", console)
    assert common.set_threads(2) == 2 and console.export_text() == ""
    assert common.set_threads(2, say=True) == 2 and "CPU threads: 2 (--threads)" in console.export_text()
    with pytest.raises(Exception, match="--threads must be >= 1"):
        apply_threads(0)
