"""``maskkv batch --ray`` on a real local Ray cluster (2 CPUs, started once for this module) with the tiny model.

Skipped, with the reason in the summary, only when Ray cannot be imported (``pip install -e '.[dev,ray]'``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[dev,ray]' runs these tests")

from pdfs import BODY, make_pdf  # noqa: E402

from maskkv_cli.batch.folder import read_rows  # noqa: E402
from maskkv_cli.batch.jobs import AnswerSettings, JobSpec  # noqa: E402
from maskkv_cli.batch.run import Runner, run_batch  # noqa: E402

SETTINGS = AnswerSettings(policy="maskkv-plus", budget=16, gen_length=8, steps=8, block_length=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local Ray cluster of 2 CPUs in its own temp folder; yields its address for other drivers."""
    temp = tmp_path_factory.mktemp("ray")
    # On an overloaded machine Ray's agents can take minutes to start: wait longer for them, and try twice.
    options = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, "_temp_dir": str(temp),
               "_system_config": {"agent_register_timeout_ms": 300_000}}
    try:
        ray.init(**options)
    except Exception as exc:  # the node timed out during startup
        print(f"Ray did not start ({exc}); trying once more")
        ray.shutdown()
        ray.init(**options)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def docs(tmp_path: Path) -> list[Path]:
    story = tmp_path / "story.pdf"
    story.write_bytes(make_pdf(BODY))
    notes = tmp_path / "notes.txt"
    notes.write_text("The river runs past the old mill. The special magic number for apple is 48213.\n")
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(make_pdf(BODY)[:300])
    return [story, notes, broken]


def _specs(docs: list[Path], questions: list[str]) -> list[JobSpec]:
    return [JobSpec(f"{d.stem}-{i}", str(d), q) for d in docs for i, q in enumerate(questions)]


def _answers(folder: Path) -> dict[str, tuple[str | None, str | None]]:
    rows, broken = read_rows(folder / "answers.jsonl")
    assert not broken
    assert len({r["key"] for r in rows}) == len(rows), "a job has two rows"
    return {r["key"]: (r["answer"], r["error"]) for r in rows}


def test_ray_answers_equal_one_process_a_killed_actor_retries_a_corrupt_pdf_fails(
        cluster: str, tmp_path: Path, docs: list[Path], tiny_dir: Path) -> None:
    # One Ray run checks three things (each actor start costs seconds on 2 shared cores).
    specs = _specs(docs, ["What does the keeper write?", "Who comes at night?", "What is the number?"])
    killed: list[str] = []

    def kill_first(pool: object, worker: int, job: object) -> None:
        if not killed:  # the job has been sent to this actor and is in flight when the actor dies
            killed.append(job.key)  # type: ignore[attr-defined]
            ray.kill(pool.actor(worker))  # type: ignore[attr-defined]

    remote = run_batch(specs, SETTINGS, str(tiny_dir), tmp_path / "ray", runner=Runner(ray=cluster),
                       on_submit=kill_first)
    local = run_batch(specs, SETTINGS, str(tiny_dir), tmp_path / "local")
    assert "Ray actor" in remote.runner
    # the same answers as one process, every job once
    assert (remote.total, remote.ok, remote.failed) == (local.total, local.ok, local.failed) == (9, 6, 3)
    assert _answers(tmp_path / "ray") == _answers(tmp_path / "local")
    # the killed actor's job ran again elsewhere
    rows = {r["key"]: r for r in read_rows(tmp_path / "ray" / "answers.jsonl")[0]}
    assert rows[killed[0]]["attempts"] == 2 and rows[killed[0]]["answer"] is not None
    # the corrupt PDF's jobs are recorded failures with a one-line reason
    errors = [r["error"] for r in rows.values() if r["error"]]
    assert len(errors) == 3 and all("broken.pdf" in e and "\n" not in e for e in errors)


def test_driver_killed_mid_run_and_restarted_finishes_every_job_once(cluster: str, tmp_path: Path,
                                                                     docs: list[Path], tiny_dir: Path) -> None:
    questions = [f"What is the special magic number for item {i}?" for i in range(20)]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": s.id, "document": s.document, "question": s.question}) + "\n"
                            for s in _specs(docs[:2], questions)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "maskkv_cli", "batch", str(jobs), "--out", str(out), "--ray", cluster,
               "--workers", "1", "--model", str(tiny_dir), "--policy", SETTINGS.policy, "--budget", "16", "-n", "8",
               "--steps", "8",
               "--block-length", "8", "--json"]  # one actor: the restart need not wait for the dead driver's to go
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    answers = out / "answers.jsonl"
    # generous: on a loaded 2-core machine the actor's start and model load alone took over a minute; the loop
    # leaves as soon as four answers are written
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        if answers.is_file() and answers.read_bytes().count(b"\n") >= 4:
            break
        time.sleep(0.05)
    assert driver.poll() is None, "the driver finished before it could be killed"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    before = _answers(out)
    assert 4 <= len(before) < 40
    again = run_batch(_specs(docs[:2], questions), SETTINGS, str(tiny_dir), out, runner=Runner(ray=cluster, workers=1))
    assert (again.total, again.ok, again.failed) == (40, 40, 0) and again.reused >= len(before)
    after = _answers(out)
    assert len(after) == 40 and all(error is None for _, error in after.values())
    assert all(after[key] == value for key, value in before.items())
