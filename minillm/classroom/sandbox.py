"""How a student's code is run: a child process with limits, in a scratch folder, walled off from the rest.

Grading a student runs the exercises' checks in a pytest process that imports the student's files
(grading.py), and a full check ends with ``minillm generate --student-dir`` importing them as one
engine (grading.run_assembled_engine): untrusted code. :func:`run` starts those processes here, as
strongly walled off as the machine allows (:func:`isolation` probes it once):

    grader (root)
      │ copies the student's folder            /tmp/minillm-sandbox-XXXX/alice/  (cwd and HOME)
      └─► unshare --mount --net --pid --fork   its own mounts, no network, its own process ids
           └─► python -I -S sandbox.py SPEC    the namespace's first process, still root:
                │  /tmp /var/tmp /dev/shm /run/lock   fresh and empty (tmpfs), the scratch put back
                │  the homes, the class folder        hidden behind empty folders (tmpfs); the Python
                │                                     install and the checkout put back, read-only
                └─► python -m pytest ...  as nobody   limits: CPU time, memory, open files, file size,
                                                      processes (a cgroup's pids.max)
      ◄── its output, read with a cap; a watchdog for time and processes; its exit status

Each limit ends in one line the grade shows ("printed more than 2048 KiB", "started more than 64
processes", ...): :func:`run` returns why it stopped a run, :func:`explain` leads a check's failure
with the limit it ran into. A teacher who is not root gets the limits, the scratch folder and the
scrubbed environment, but the code runs as the teacher (:meth:`Isolation.describe` says what holds).

This module imports only the standard library: its own file is the wrapper (``python -I -S sandbox.py``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import pwd
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

POLL_S = 0.1  # how often the watchdog looks (output is read as it comes)
UNPRIVILEGED_USER = "nobody"
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the world-writable folders: fresh inside
HOMES = ("/root", "/home")  # hidden inside, with the grader's own home


@dataclass(frozen=True)
class Limits:
    """What one student's pytest process may use; past any of them the exercise scores zero.

    Measured on the reference solutions (``minillm check --reference``, all 21 exercises in one
    pytest process, 2-core VM): 964 MiB of address space at the peak (439 MiB resident), 2 threads,
    11 s of CPU; they still all pass with 1024 MiB, 4 processes, 32 open files, 1 MiB files and
    16 KiB of output (at 896 MiB ex07 segfaults in torch, at 768 MiB ex06 fails too).
    """

    cpu_s: int = 1800  # RLIMIT_CPU of each process; grading sets the run's wall-clock budget and 60 s
    memory_mib: int = 3072  # RLIMIT_AS (address space, which torch reserves more of than it touches): 3x what passes
    processes: int = 64  # processes and threads at once (a cgroup's pids.max, else RLIMIT_NPROC): 16x what passes
    open_files: int = 256  # RLIMIT_NOFILE: 8x what passes
    file_mib: int = 64  # RLIMIT_FSIZE, the largest file it may write; also the size of each private /tmp
    output_kib: int = 2048  # what it may print: pytest -v's tracebacks of a class of failing checks fit


@dataclass(frozen=True)
class Isolation:
    """What this machine lets :func:`run` enforce, beyond the limits (which hold everywhere on POSIX).

    namespaces: unshare gave each run its own mounts (private /tmp, homes and class folder hidden),
        no network and its own process ids.
    user: the unprivileged user the student's code runs as ("nobody", when the grader is root);
        None: the grader's own user.
    processes: how the count of processes is bounded: "cgroup" (pids.max, this run's alone),
        "rlimit" (RLIMIT_NPROC: every process of the user counts) or "watchdog" (counted every
        0.1 s and stopped: a fork bomb gets that long).
    """

    namespaces: bool
    user: str | None
    processes: str

    def describe(self) -> list[str]:
        """One line per wall: what holds here and what does not."""
        lines = ["limits: CPU time, memory, open files, file size and output, on every POSIX machine"]
        lines.append({"cgroup": "processes: a cgroup of its own (pids.max)",
                      "rlimit": "processes: RLIMIT_NPROC (counts every process of the user it runs as)",
                      "watchdog": "processes: NOT bounded by the kernel here (root, no cgroup): a watchdog "
                                  "counts them every 0.1 s"}[self.processes])
        if self.namespaces:
            lines += ["network: none (a network namespace of its own)",
                      "files: its own /tmp; the homes and the class folder hidden; the checkout read-only"]
        else:
            lines += ["network: NOT cut off (no namespaces here: unshare missing or refused)",
                      "files: NOT hidden (no namespaces here)"]
        lines.append(f"user: {self.user} (other students' copies and the grader's files: denied by permissions)"
                     if self.user else "user: NOT switched: the code runs as the grader (not root), with its rights")
        return lines


@functools.lru_cache(maxsize=None)
def isolation() -> Isolation:
    """Probe once what this machine allows, by starting Python inside the walls (0.2 s)."""
    root = os.geteuid() == 0
    user = UNPRIVILEGED_USER if root and _has_user(UNPRIVILEGED_USER) else None
    namespaces = _walls_hold(Isolation(True, user, _process_bound(user)))
    if user and not namespaces and not _walls_hold(Isolation(False, user, _process_bound(user))):
        user = None  # the interpreter lies where nobody may not go (a 0700 home) and no namespace can lend it
    return Isolation(namespaces, user, _process_bound(user))


def _process_bound(user: str | None) -> str:
    """RLIMIT_NPROC never applies to root (user id 0): root bounds processes with a cgroup or not at all."""
    root = os.geteuid() == 0
    return "cgroup" if root and _pids_cgroup_parent() else "rlimit" if user or not root else "watchdog"


def _walls_hold(how: Isolation) -> bool:
    """Whether Python starts inside the walls ``how`` names (unshare, the mounts, the user switch)."""
    with tempfile.TemporaryDirectory() as empty, scratch(Path(empty), how.user) as box:
        cmd = _wrapper([sys.executable, "-I", "-S", "-c", "pass"], box, Limits(), Path(__file__).parents[2], how)
        try:
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=60, cwd="/").returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


# -- the scratch folder ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scratch:
    """One run's folders: ``base`` (the grader's, 0711) holds ``folder`` (a copy of the student's
    files, the code's cwd and HOME), ``tmp`` (its TMPDIR) and ``progress`` (the checks' lines)."""

    base: Path
    folder: Path
    source: Path  # the student's own folder

    @property
    def progress(self) -> Path:
        return self.base / "progress.jsonl"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def status(self) -> Path:
        return self.base / "status.json"  # the exit status, written by the namespace's first process


@contextmanager
def scratch(source: Path, user: str | None = None) -> Iterator[Scratch]:
    """A fresh copy of ``source`` to run in, removed afterwards; owned by ``user`` if given.

    Symbolic links are copied as links (the grader never reads through a student's link);
    __pycache__ and .git are left out.
    """
    base = Path(tempfile.mkdtemp(prefix="minillm-sandbox-"))
    try:
        box = Scratch(base, base / (Path(source).resolve().name or "student"), Path(source))
        shutil.copytree(source, box.folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", ".git"))
        box.tmp.mkdir()
        box.progress.touch()
        if user is not None:
            entry = pwd.getpwnam(user)
            for path in (box.folder, *box.folder.rglob("*"), box.tmp, box.progress):
                os.lchown(path, entry.pw_uid, entry.pw_gid)
            os.chmod(base, 0o711)  # it can reach its own folder by name, list nothing, create nothing
            os.chmod(box.folder, 0o700)
        yield box
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- running -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    """How a sandboxed run ended: its exit code (-N: killed by signal N), why it was stopped ("" if
    it ended by itself; else one line: "printed more than 2048 KiB ...") and its output (capped)."""

    returncode: int
    stopped: str
    output: str


def run(cmd: list[str], box: Scratch, limits: Limits, checkout: Path, watch: Callable[[], str] = lambda: "",
        verbose: bool = False, read_only: tuple[Path, ...] = ()) -> Ran:
    """Run ``cmd`` (a Python command: ``cmd[0]`` is this interpreter) in ``box``, walled off as far as
    :func:`isolation` allows. ``checkout`` (the minillm clone) stays visible, read-only, on PYTHONPATH;
    so do the folders of ``read_only`` (a model's weights under a hidden home), bound back as the checkout is.

    Every 0.1 s ``watch()`` may return a reason to stop (a timeout, as one line); the output is
    read as it comes, echoed when ``verbose``, and the run is stopped once it passes
    ``limits.output_kib``; a run that reaches ``limits.processes`` is stopped too. Stopping kills
    every process the run started. Raises OSError if the sandbox itself cannot start.
    """
    how = isolation()
    cgroup = _make_cgroup(limits.processes) if how.processes == "cgroup" else None
    try:
        wrapper = _wrapper(cmd, box, limits, checkout, how, cgroup, verbose, read_only)
        proc = subprocess.Popen(wrapper, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_student_env(box, checkout, verbose))
        output, stopped = _watch(proc, limits, cgroup, watch, verbose)
        returncode = proc.wait()
        if cgroup is not None and not stopped and _cgroup_hit_limit(cgroup):
            stopped = _too_many_processes(limits)
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
    if box.status.is_file():  # the namespace's first process reports how pytest ended (signals included)
        returncode = json.loads(box.status.read_text())["returncode"]
    return Ran(returncode, stopped, output.decode(errors="replace"))


def _wrapper(cmd: list[str], box: Scratch, limits: Limits, checkout: Path, how: Isolation, cgroup: Path | None = None,
             verbose: bool = False, read_only: tuple[Path, ...] = ()) -> list[str]:
    """The command line that starts ``cmd`` inside the walls: unshare, then this file as the wrapper."""
    spec = {"cmd": cmd, "cwd": str(box.folder), "env": _student_env(box, checkout, verbose),
            "rlimits": _rlimits(limits, how), "user": how.user, "cgroup": str(cgroup) if cgroup else None,
            "status": str(box.status), "init": how.namespaces,
            "mounts": _mount_plan(box, checkout, limits, read_only) if how.namespaces else None}
    return [*(_unshare_prefix(os.geteuid() == 0) if how.namespaces else []),
            sys.executable, "-I", "-S", str(Path(__file__).resolve()), json.dumps(spec)]


def explain(message: str, limits: Limits, box: Scratch) -> str:
    """A check's failure message, with the scratch folder's path put back to the student's, led by
    the limit or the wall of the sandbox it ran into (one line, :func:`wall_hit`) when it shows one."""
    message = message.replace(str(box.folder), str(box.source))
    wall = wall_hit(message, limits, box)
    return f"{wall}: {message}" if wall else message


def wall_hit(message: str, limits: Limits, box: Scratch) -> str:
    """The limit or the wall of the sandbox a failure ``message`` shows it ran into, in one line; else ""."""
    if re.search(r"MemoryError|can't allocate memory|Cannot allocate memory|std::bad_alloc", message):
        return f"used more than {limits.memory_mib} MiB of memory (the grader's limit)"
    if re.search(r"BlockingIOError: \[Errno 11\]|can't start new thread", message):
        return _too_many_processes(limits)
    if "[Errno 27] File too large" in message:
        return f"wrote a file larger than {limits.file_mib} MiB (the grader's limit)"
    if "[Errno 24] Too many open files" in message:
        return f"opened more than {limits.open_files} files at once (the grader's limit)"
    denied = re.search(r"\[Errno (?:13\] Permission denied|30\] Read-only file system): '(/[^']*)'", message)
    if denied and not any(Path(denied.group(1)).is_relative_to(own) for own in (box.source, box.folder)):
        return (f"permission denied for {denied.group(1)}: outside its own folder (the grader runs each student's "
                "code walled off)")
    return ""


def explain_crash(returncode: int, output: str, limits: Limits) -> str:
    """Why a process ended that no one stopped: a limit when its signal or its last words show one, else ""."""
    if returncode == -signal.SIGXCPU:
        return f"used more than {limits.cpu_s} s of CPU time (the grader's limit)"
    if re.search(r"MemoryError|std::bad_alloc|can't allocate memory|Cannot allocate memory", output[-4000:]):
        return f"used more than {limits.memory_mib} MiB of memory (the grader's limit)"
    return ""


def _watch(proc: subprocess.Popen, limits: Limits, cgroup: Path | None, watch, verbose: bool) -> tuple[bytes, str]:
    """Read ``proc``'s output until it ends; stop it (every process it started) for a reason. Returns
    (the output, up to the cap; the reason or "")."""
    fd, out, stopped = proc.stdout.fileno(), bytearray(), ""
    cap = limits.output_kib * 1024
    while True:
        ready = select.select([fd], [], [], POLL_S)[0] if fd >= 0 else time.sleep(POLL_S)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # its end of the pipe closed: it ended (or closed it and goes on)
                fd = -1
            if len(out) + len(chunk) > cap:
                stopped = f"printed more than {limits.output_kib} KiB (the grader's limit): print() in a loop?"
            chunk = chunk[:cap - len(out)]
            out += chunk
            if verbose:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
        stopped = stopped or watch() or _processes_over(proc, limits, cgroup)
        if stopped or (proc.poll() is not None and fd < 0) or (proc.poll() is not None and not ready):
            break
    if stopped or proc.poll() is None:
        _kill(proc, cgroup)
    proc.stdout.close()
    return bytes(out), stopped


def _processes_over(proc: subprocess.Popen, limits: Limits, cgroup: Path | None) -> str:
    if cgroup is not None:
        hit = _cgroup_hit_limit(cgroup)
    else:  # RLIMIT_NPROC bounds them, or nothing does (root without a cgroup): count the session's
        hit = _session_tasks(proc.pid) >= limits.processes
    return _too_many_processes(limits) if hit else ""


def _too_many_processes(limits: Limits) -> str:
    return f"started too many processes (more than {limits.processes} at once, the grader's limit): a fork bomb?"


def _kill(proc: subprocess.Popen, cgroup: Path | None) -> None:
    """Kill the run and everything it started: its process group, and its cgroup's processes (which
    a process that left the group cannot leave). With namespaces, the first one's end kills the rest."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if cgroup is not None:
        _kill_cgroup(cgroup)


def _student_env(box: Scratch, checkout: Path, verbose: bool) -> dict[str, str]:
    """The environment of the student's code: nothing of the grader's but PATH and LANG."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "HOME": str(box.folder), "TMPDIR": str(box.tmp), "PYTHONPATH": str(checkout),
           "PYTHONSAFEPATH": "1",  # the scratch folder (cwd) is not on sys.path: a student's torch.py shadows nothing
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return env | ({"PYTHONUNBUFFERED": "1"} if verbose else {})


def _rlimits(limits: Limits, how: Isolation) -> dict[str, int]:
    mib = 1 << 20
    rlimits = {"RLIMIT_CPU": limits.cpu_s, "RLIMIT_AS": limits.memory_mib * mib, "RLIMIT_NOFILE": limits.open_files,
               "RLIMIT_FSIZE": limits.file_mib * mib, "RLIMIT_CORE": 0}
    if how.processes == "rlimit":  # it counts every process of the user: the grader's own too, when not root
        rlimits["RLIMIT_NPROC"] = limits.processes + (0 if how.user else _user_tasks(os.getuid()))
    return rlimits


# -- probes -----------------------------------------------------------------------------------


def _unshare_prefix(root: bool) -> list[str]:
    user = [] if root else ["--user", "--map-root-user"]  # a teacher who is not root: a user namespace
    return ["unshare", *user, "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _user_tasks(uid: int) -> int:
    """The processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def _session_tasks(session: int) -> int:
    """The processes and threads of a session (the watchdog's count where nothing else bounds them)."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session:  # fields after the name: state ppid pgrp session ... num_threads (18th)
            count += int(fields[17])
    return count


# -- a cgroup of its own: the count of processes ---------------------------------------------------


def _pids_cgroup_parent() -> Path | None:
    """Where this process may create a cgroup with a pids controller (cgroup v1 or v2), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        elif number == "0":
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                if "pids" not in (folder / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        if (folder / "cgroup.procs").is_file() and os.access(folder, os.W_OK):
            return folder
    return None


def _make_cgroup(processes: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="minillm-sandbox-", dir=_pids_cgroup_parent()))  # mkdtemp: a unique name
    (folder / "pids.max").write_text(str(processes))
    return folder


def _cgroup_hit_limit(cgroup: Path) -> bool:
    """Whether a fork was refused for pids.max (its events count them)."""
    try:
        events = dict(line.split() for line in (cgroup / "pids.events").read_text().splitlines())
    except OSError:
        return False
    return int(events.get("max", 0)) > 0


def _kill_cgroup(cgroup: Path) -> None:
    for _ in range(50):  # a fork bomb forks while it is killed: again until none is left
        pids = (cgroup / "cgroup.procs").read_text().split()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove_cgroup(cgroup: Path) -> None:
    _kill_cgroup(cgroup)
    for _ in range(100):
        try:
            cgroup.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                return
            time.sleep(0.02)


# -- inside: the namespace's first process, then the student's ---------------------------------------


def _mount_plan(box: Scratch, checkout: Path, limits: Limits, read_only: tuple[Path, ...] = ()) -> dict:
    """The folders to replace with empty ones and those to put back (see the module's diagram);
    ``read_only``: more folders to put back, read-only (a model's weights)."""
    homes = {*HOMES, pwd.getpwuid(os.getuid()).pw_dir, os.environ.get("HOME", "/")} - {"/"}
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    site = [p for p in sys.path if p and any(Path(p).is_relative_to(q) for q in prefixes) or "-packages" in p]
    needed = {str(q) for p in [*prefixes, *site, str(checkout), str(Path(sys.executable).parent), *map(str, read_only)]
              for q in (Path(p).absolute(), Path(p).resolve()) if q.is_dir()}
    class_folder = Path(box.source).resolve().parent  # the other students' folders, beside this one's
    close = [str(class_folder)] if class_folder != Path("/") and not any(
        Path(n).is_relative_to(class_folder) for n in [*needed, str(box.base)]) else []
    return {"private": [d for d in PRIVATE_DIRS if Path(d).is_dir()], "size_mib": limits.file_mib,
            "hide": sorted(h for h in homes if Path(h).is_dir()), "close": close,
            "read_only": sorted(needed), "writable": [str(box.base)]}


_libc = None
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    global _libc
    _libc = _libc or ctypes.CDLL(None, use_errno=True)
    enc = (lambda s: None if s is None else s.encode())
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {source or ''} on {target}: {os.strerror(e)}")


def _under(path: str, folders: list[str]) -> bool:
    return any(Path(path).is_relative_to(f) for f in folders)


def _set_up_mounts(plan: dict) -> None:
    """Replace the private folders and the homes with empty tmpfs, bind back what the run needs,
    then close the class folder (a tmpfs no one but root may enter).

    Runs as root inside the new mount namespace, before the switch to the student's user: the
    kept folders are opened first (O_PATH), so they can be bound back from under what hides them.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the grader's namespace
    gone = plan["private"] + plan["hide"]
    keep = [(p, p in plan["writable"]) for p in sorted(plan["writable"] + plan["read_only"], key=len)]
    keep = [(p, w) for i, (p, w) in enumerate(keep) if _under(p, gone) and not _under(p, [q for q, _ in keep[:i]])]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p, _ in keep}
    for folder in plan["private"]:
        _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={plan['size_mib']}m")
    for folder in plan["hide"]:  # 0711: a way through to what is bound back, nothing to list or create
        _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=1m")
    for path, writable in keep:
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fds[path]}", path, None, MS_BIND | MS_REC)
        os.close(fds[path])
    for folder in plan["close"]:
        os.makedirs(folder, mode=0o755, exist_ok=True)  # (gone with a private /tmp: its path comes back, closed)
        _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0,size=1m")
    _read_only_elsewhere(plan["private"] + plan["writable"])


def _read_only_elsewhere(writable: list[str]) -> None:
    """Every other mount read-only, in this namespace's view only (MS_BIND: never the file system
    itself); /proc, /sys and /dev keep theirs (device files, the kernel's own permissions)."""
    points = {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
              for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    for point in sorted(points, key=len):
        if _under(point, writable) or _under(point, ["/proc", "/sys", "/dev"]):
            continue
        locked = os.statvfs(point).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # ST_* = MS_* for these
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _become_student(spec: dict) -> None:
    """Join the cgroup, take the limits and the user, and exec the command: never returns."""
    if spec["cgroup"]:
        Path(spec["cgroup"], "cgroup.procs").write_text("0")
    for name, value in spec["rlimits"].items():  # RLIMIT_CPU: SIGXCPU at the limit, SIGKILL 5 s later
        resource.setrlimit(getattr(resource, name), (value, value + 5 if name == "RLIMIT_CPU" else value))
    if spec["user"]:
        entry = pwd.getpwnam(spec["user"])
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
    elif spec["init"] and os.geteuid() == 0:  # root of a user namespace (the grader is not root): drop its powers
        _drop_capabilities()
    os.chdir(spec["cwd"])
    os.execve(spec["cmd"][0], spec["cmd"], spec["env"])


def _drop_capabilities() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, pr_set_no_new_privs = 24, 38
    for cap in range(64):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            break
    libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0)


def _enter(spec: dict) -> None:
    """The wrapper: set up the walls; with namespaces, stay as their first process (a pid namespace's
    init ignores signals it has no handler for, so pytest must not be it) and report pytest's status."""
    if spec["mounts"]:
        _set_up_mounts(spec["mounts"])
    if not spec["init"]:
        _become_student(spec)
    child = os.fork()
    if child == 0:
        try:
            _become_student(spec)
        finally:
            os._exit(127)
    while True:  # reap every orphan until pytest itself ends
        pid, status = os.wait()
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    Path(spec["status"]).write_text(json.dumps({"returncode": code}))
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    _enter(json.loads(sys.argv[1]))
