"""The emulator's worker pool: a task never waits behind another, threads are reused."""

from __future__ import annotations

import threading

from dp_testing.emulator._workers import Workers

WAIT = 5.0


def test_tasks_run_concurrently_and_threads_are_reused() -> None:
    workers = Workers()
    release = threading.Event()
    started = [threading.Event() for _ in range(3)]
    names: list[str] = []

    def blocker(i: int) -> None:
        names.append(threading.current_thread().name)
        started[i].set()
        release.wait(WAIT)

    tasks = [workers.submit(lambda i=i: blocker(i), f"law-{i}") for i in range(3)]
    # All three block at once: none was queued behind a running one.
    assert all(e.wait(WAIT) for e in started)
    assert sorted(names) == ["law-0", "law-1", "law-2"]
    threads = {t.thread for t in tasks}
    assert len(threads) == 3
    release.set()
    assert all(t.join(WAIT) for t in tasks)

    again = [workers.submit(lambda: None, f"again-{i}") for i in range(3)]
    assert all(t.join(WAIT) for t in again)
    assert {t.thread for t in again} <= threads
    workers.close()


def test_failing_task_ends_and_its_thread_keeps_serving() -> None:
    workers = Workers()

    def boom() -> None:
        raise RuntimeError("boom")

    failed = workers.submit(boom, "boom")
    assert failed.join(WAIT)
    ok = workers.submit(lambda: None, "ok")
    assert ok.join(WAIT)
    assert ok.thread is failed.thread
    workers.close()
