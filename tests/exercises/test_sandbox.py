"""The sandbox `minillm check` runs a student's code in (minillm/classroom/sandbox.py).

A class of hostile ex01s (a fork bomb, a memory balloon, endless output, reading another student's
file, writing to the teacher's home, os._exit at import, a sleep) is graded with an honest student,
two at a time: each hostile one gets one line naming what it tried and a zero, the honest one
passes, and nothing outside the scratch folders changes. The limits are small: the class takes
about 30 s, once for all the tests.
"""

import os
import re
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from minillm.classroom import run_checks, sandbox
from minillm.classroom.sandbox import Limits

pytestmark = pytest.mark.grader

LIMITS = Limits(cpu_s=120, memory_mib=1536, processes=32, open_files=128, file_mib=8, output_kib=64)
TIMEOUT_S = 8.0
HONEST = "from minillm.model import causal_mask  # noqa: F401\n"
WALLED = pytest.mark.skipif(not (sandbox.isolation().namespaces or sandbox.isolation().user),
                            reason="no namespaces and no other user here: files outside the folder are not walled off")


def hostile(body: str, top: str = "") -> str:
    """An ex01 whose causal_mask does ``body`` (and whose file does ``top`` when imported)."""
    return textwrap.dedent(top) + "\n\ndef causal_mask(n_queries, n_keys, device=None, window=None):\n" + \
        textwrap.indent(textwrap.dedent(body), "    ") + "\n"


SUFFIX = uuid.uuid4().hex[:8]  # in the folders' names: what the sandbox left running is found by them
BOB = "bob"  # the honest student, graded with them
PWNED = Path.home() / f"pwned-{SUFFIX}"  # what one of them tries to write in the teacher's home
HOSTILE = {  # student: (their ex01, how the first line of their failure begins)
    "forkbomb": (hostile("""\
        import os
        while True:
            os.fork()
    """), "started too many processes (more than 32 at once, the grader's limit): a fork bomb?"),
    "balloon": (hostile("""\
        ballast = bytearray(50 * 2**30)  # 50 GiB
        return ballast
    """), "used more than 1536 MiB of memory (the grader's limit): causal_mask(4, 4): raised MemoryError"),
    "chatty": (hostile("""\
        while True:
            print("all work and no play " * 40)
    """), "printed more than 64 KiB (the grader's limit): print() in a loop?"),
    "snoop": (hostile("""\
        return open(BOB_FILE).read()
    """, top="BOB_FILE = ..."), "permission denied for {bob_file}: outside its own folder"),
    "vandal": (hostile(f"""\
        open({str(PWNED)!r}, "w").write("pwned")
    """), f"permission denied for {PWNED}: outside its own folder"),
    "quitter": (hostile("return None", top="import os\nos._exit(0)\n"),
                "exited during import of ex01_causal_mask.py (exit code 0)"),
    "sleeper": (hostile("""\
        import time
        time.sleep(10**6)
    """), f"timed out: an infinite loop? ex01 was still running after {TIMEOUT_S:g} s"),
}
NEEDS_WALLS = {"snoop", "vandal"}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade the class (every hostile student and bob), two students at a time as ``--jobs 2`` does;
    with what lay outside the scratch folders before and after."""
    class_dir = tmp_path_factory.mktemp("class")
    folders = {name: class_dir / f"{name}-{SUFFIX}" for name in [*HOSTILE, BOB]}
    bob_file = folders[BOB] / "ex01_causal_mask.py"
    for name, folder in folders.items():
        folder.mkdir()
        code = HONEST if name == BOB else HOSTILE[name][0].replace("BOB_FILE = ...", f"BOB_FILE = {str(bob_file)!r}")
        (folder / "ex01_causal_mask.py").write_text(code)
    before = _files(class_dir)
    home_before = set(os.listdir(Path.home()))
    try:
        with ThreadPoolExecutor(2) as pool:
            results = dict(zip(folders, pool.map(
                lambda f: run_checks(["ex01"], f, timeout_s=TIMEOUT_S, limits=LIMITS)[0], folders.values())))
        yield SimpleNamespace(results=results, bob_file=bob_file, changed=_files(class_dir) != before,
                              home_new=set(os.listdir(Path.home())) - home_before, pwned=PWNED.exists(),
                              left_running=_processes_running_in(f"-{SUFFIX}"))
    finally:
        PWNED.unlink(missing_ok=True)


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _processes_running_in(name: str) -> int:
    """Processes whose command line names a folder whose name holds ``name`` (what the sandbox left running)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            count += name.encode() in cmdline.read_bytes()
        except OSError:
            continue
    return count


@pytest.mark.parametrize("student", [pytest.param(name, marks=WALLED if name in NEEDS_WALLS else ())
                                     for name in HOSTILE])
def test_a_hostile_student_gets_one_line_naming_it_and_a_zero(graded, student):
    ex01 = graded.results[student]
    failed = next(c for c in ex01.checks if c.outcome == "failed")
    assert failed.message.startswith(HOSTILE[student][1].format(bob_file=graded.bob_file)), failed.message
    assert failed.stopped and failed.message.startswith(failed.stopped)  # more than a wrong answer, said in a line
    assert ex01.status == "failed"  # a zero: 1 point only when every check passes


def test_the_honest_student_graded_beside_them_passes(graded):
    assert graded.results[BOB].status == "passed", [c.message for c in graded.results[BOB].checks]


def test_nothing_outside_the_scratch_folders_changed(graded):
    assert not graded.changed, "a student's folder changed"
    assert not graded.pwned and not {n for n in graded.home_new if "pwned" in n}, graded.home_new
    assert graded.left_running == 0, "a hostile student's process outlived its grading"


def test_a_stopped_check_leaves_the_exercises_other_checks_not_run(graded):
    for student in ("forkbomb", "chatty", "quitter", "sleeper"):
        checks = graded.results[student].checks
        assert [c.outcome for c in checks] == ["failed"] + ["not run"] * (len(checks) - 1), student


def test_the_code_runs_in_its_scratch_folder_with_a_scrubbed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_SECRET_TOKEN", "do-not-leak")
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "notes.txt").write_text("mine")
    (tmp_path / "alice" / "link").symlink_to("/etc/hostname")
    spy = textwrap.dedent("""\
        import json, os, socket
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=2)
            network = "reached"
        except OSError as e:
            network = type(e).__name__
        print(json.dumps({"env": sorted(os.environ), "cwd": os.getcwd(), "home": os.environ["HOME"],
                          "notes": open("notes.txt").read(), "uid": os.getuid(), "network": network}))
    """)
    with sandbox.scratch(tmp_path / "alice", sandbox.isolation().user) as box:
        assert (box.folder / "link").is_symlink()  # copied as a link: the grader never reads through it
        ran = sandbox.run([sys.executable, "-c", spy], box, LIMITS, Path.cwd())
        seen = __import__("json").loads(ran.output)
    assert ran.returncode == 0 and ran.stopped == ""
    assert seen["cwd"] == seen["home"] == str(box.folder) and seen["notes"] == "mine"
    assert set(seen["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONPATH", "PYTHONSAFEPATH",
                                "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED"}
    if sandbox.isolation().namespaces:
        assert seen["network"] != "reached"
    if sandbox.isolation().user:
        assert seen["uid"] != os.getuid()
    assert not box.base.exists()  # the scratch folder goes with the run


def test_a_busy_loop_ends_at_the_cpu_time_limit(tmp_path):
    (tmp_path / "alice").mkdir()
    limits = Limits(cpu_s=1)
    with sandbox.scratch(tmp_path / "alice", sandbox.isolation().user) as box:
        ran = sandbox.run([sys.executable, "-c", "while True: pass"], box, limits, Path.cwd(),
                          watch=lambda: "")  # no wall-clock timeout: the kernel's CPU limit ends it
    assert ran.stopped == "" and sandbox.explain_crash(ran.returncode, ran.output, limits) == \
        "used more than 1 s of CPU time (the grader's limit)"


def test_the_isolation_says_what_it_enforces():
    lines = sandbox.isolation().describe()
    assert lines[0].startswith("limits: CPU time, memory, open files, file size and output")
    assert any(re.match(r"processes: ", line) for line in lines) and any(line.startswith("user: ") for line in lines)


def test_failure_messages_name_the_limit_they_ran_into(tmp_path):
    box = sandbox.Scratch(tmp_path, tmp_path / "alice", Path("/class/alice"))

    def explain(message):
        return sandbox.explain(message, LIMITS, box)

    assert explain("MemoryError").startswith("used more than 1536 MiB of memory")
    assert explain("RuntimeError: DefaultCPUAllocator: can't allocate memory").startswith("used more than 1536 MiB")
    assert explain("BlockingIOError: [Errno 11] Resource temporarily unavailable").startswith("started too many")
    assert explain("OSError: [Errno 27] File too large").startswith("wrote a file larger than 8 MiB")
    assert explain("OSError: [Errno 24] Too many open files").startswith("opened more than 128 files at once")
    assert explain("PermissionError: [Errno 13] Permission denied: '/root/x'").startswith(
        "permission denied for /root/x: outside its own folder")
    assert explain(f"could not load {tmp_path}/alice/ex01.py: boom") == "could not load /class/alice/ex01.py: boom"
    assert explain("PermissionError: [Errno 13] Permission denied: '/class/alice/x'").startswith("PermissionError")
    assert explain("causal_mask(2, 2): wrong values") == "causal_mask(2, 2): wrong values"
