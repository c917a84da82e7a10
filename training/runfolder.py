"""The run folder's guards: one writer at a time, whole files only.

    with RunLock(out_dir) as lock:              # <out_dir>/.lock, created with O_EXCL, names its holder
        if lock.took_over: ...                   # replaced a lock left by a process that no longer runs
        remove_stale_temp_files(out_dir)         # -> (count, bytes) of ".tmp-*" files a killed write left
        write_text_atomic(path, text)            # temp file in the same folder, fsync, rename
        with atomic_file(path, "wb") as f: ...   # the same for any writer (a figure's savefig)

The lock file holds one JSON line {"pid", "host", "started", "proc_start"} (proc_start: the kernel's start
time of the process, where /proc has it, so that a reused pid is not mistaken for the holder). Acquiring it:

- no lock file: created with O_CREAT | O_EXCL, so of two writers starting at once exactly one gets it;
- a lock of a process that still runs on this host: RunFolderError naming pid@host;
- a lock of a process that no longer runs on this host (killed, crashed): taken over, `took_over` names it;
- a lock from another host: never taken over (this machine cannot see that process); RunFolderError says
  how to remove it by hand.

The lock is removed when the `with` block ends, however it ends (return, exception, KeyboardInterrupt);
only a kill -9 or a power cut leaves it behind, and the next run on the same host takes it over.
Every temporary file a run writes into its folder starts with TEMP_PREFIX.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import time

LOCK_NAME = ".lock"
TEMP_PREFIX = ".tmp-"
_EMPTY_LOCK_GRACE_S = 5.0  # a lock file this old and still empty or unreadable was left by a killed writer


class RunFolderError(RuntimeError):
    """The run folder cannot be used: locked by another run, or not writable. One line."""


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _process_runs(pid: int, proc_start: str | None) -> bool:
    """Whether process `pid` of this host still runs and is the one that wrote the lock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return False  # exited, not reaped yet
    except (OSError, IndexError):
        pass
    now = _proc_start(pid)
    return proc_start is None or now is None or now == proc_start


class RunLock:
    """Exclusive use of a run folder by one process (see the module docstring)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.took_over: str | None = None  # who held the stale lock this one replaced, in words
        self._content: bytes | None = None

    @staticmethod
    def describe(holder: dict) -> str:
        return f"{holder.get('pid')}@{holder.get('host')} (since {holder.get('started', '?')})"

    def __enter__(self) -> "RunLock":
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise RunFolderError(f"run directory {self.folder!r} is not writable ({e.strerror or e})") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "proc_start": _proc_start(os.getpid())}
        content = (json.dumps(me) + "\n").encode()
        for _ in range(100):  # each pass either creates the lock, raises, or removes a stale one
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            except OSError as e:
                raise RunFolderError(f"run directory {self.folder!r} is not writable ({e.strerror or e})") from None
            try:
                os.write(fd, content)
                os.fsync(fd)
            except OSError as e:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.remove(self.path)
                raise RunFolderError(f"could not write {self.path} ({e.strerror or e})") from None
            os.close(fd)
            self._content = content
            return self
        raise RunFolderError(f"could not take the lock {self.path}: other processes keep replacing it")

    def _handle_existing(self) -> None:
        """Raise for a live or foreign holder; remove a stale lock (then the caller tries again)."""
        seen = self._read()
        holder = _parse(seen)
        if holder is None:
            age = _age(self.path)
            if age is not None and age < _EMPTY_LOCK_GRACE_S:
                time.sleep(0.1)  # being written by a process that has just created it
                return
            if age is not None:  # stays unreadable: its writer died between creating and filling it
                self._remove_if_unchanged(seen)
                self.took_over = "a process that died while creating it (the lock file was unreadable)"
                return
            return  # removed meanwhile
        if holder.get("host") != socket.gethostname():
            raise RunFolderError(
                f"run folder {self.folder!r} is locked by {self.describe(holder)}, a run on another machine, "
                f"which this one cannot check: if that run has ended, delete {self.path} and start again")
        if _process_runs(int(holder.get("pid", -1)), holder.get("proc_start")):
            raise RunFolderError(f"run folder {self.folder!r} is in use by {self.describe(holder)}: wait for "
                                 "that run to end, or choose another --out_dir")
        self._remove_if_unchanged(seen)
        self.took_over = f"{self.describe(holder)}, which no longer runs"

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RunFolderError(f"could not read the lock file {self.path} ({e.strerror or e})") from None

    def _remove_if_unchanged(self, seen: bytes | None) -> None:
        """Remove the lock file if it still holds `seen`. Two processes taking over the same stale lock do it
        one after the other (flock on the folder), so the second one finds the first one's lock, not `seen`."""
        dir_fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            if self._read() == seen:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
        except OSError as e:
            raise RunFolderError(f"could not remove the stale lock {self.path} ({e.strerror or e})") from None
        finally:
            os.close(dir_fd)  # releases the flock

    def __exit__(self, *exc) -> None:
        """Remove the lock file if it is still this lock's (never another process's)."""
        with contextlib.suppress(OSError):
            if self._content is not None and self._read() == self._content:
                os.remove(self.path)
        self._content = None


def _parse(content: bytes | None) -> dict | None:
    if not content:
        return None
    try:
        holder = json.loads(content)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _age(path: str) -> float | None:
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return None


def remove_stale_temp_files(folder: str) -> tuple[int, int]:
    """Remove the TEMP_PREFIX files a killed write left in `folder` (call it while holding the lock, when no
    write of this run is under way). Returns (how many, their total bytes)."""
    count = size = 0
    for entry in os.scandir(folder):
        if entry.name.startswith(TEMP_PREFIX) and entry.is_file(follow_symlinks=False):
            nbytes = entry.stat(follow_symlinks=False).st_size
            os.remove(entry.path)
            count, size = count + 1, size + nbytes
    return count, size


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w"):
    """Open a new TEMP_PREFIX file in `path`'s folder for writing ("w" or "wb"); when the block ends cleanly it is
    flushed, fsynced and renamed over `path` (created with the umask's permissions, as open() would); on any error
    it is removed and `path` is left as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f"{TEMP_PREFIX}{secrets.token_hex(8)}-{os.path.basename(path)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` with `text` whole or not at all (atomic_file). Raises OSError (the temp file removed) when
    the write fails."""
    with atomic_file(path) as f:
        f.write(text)


def format_bytes(n: int) -> str:
    """1536 → "1.5 KiB"."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
