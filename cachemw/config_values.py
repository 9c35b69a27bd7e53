"""The values settings take, read and checked: sizes (``512MiB``), seconds, ports, absolute
directories (a runtime dir short enough for the daemon's socket), and the numbers and
true/false of environment strings; every error names the option or variable the value came
from.

Apart from config.py (one dataclass per component, and the mapping of the environment onto
them) because these are the shared vocabulary of settings: the CLI, the job's options, the
tiers and the reports parse and print sizes with them, without the dataclasses. Pure: they
read no environment and import nothing of cachemw.
"""
from __future__ import annotations

import math
import os
import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Parse ``4096``, ``"512MiB"``, ``"2G"``, ``"1.5GB"`` into bytes (binary units).

    Raises ValueError naming ``name`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name}: cannot parse size {value!r} (use e.g. 512MiB, 4G, 1048576)")
    number, unit, _ = m.groups()
    return int(float(number) * (1024 ** _SIZE_UNITS[unit.lower()]))


def format_size(n: float) -> str:
    """``67108864`` -> ``"64.0 MiB"`` (binary units, as parse_size reads them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# sun_path of a Unix socket address holds 108 bytes, the terminating NUL included
SOCKET_PATH_MAX = 108
SOCKET_NAME = "daemon.sock"  # the daemon's socket in its runtime dir (protocol.SOCKET)


def check_runtime_dir(path, name: str = "runtime_dir") -> str:
    """A runtime dir must be an absolute path short enough for the daemon's socket in it.

    Relative paths are refused: every process of a node (DataLoader workers started in
    another working directory, the CLI) must find the same daemon.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name}: an absolute directory path is required, got {path!r}")
    check_absolute(path, name)
    sock = os.path.join(path, SOCKET_NAME)
    if len(os.fsencode(sock)) >= SOCKET_PATH_MAX:
        raise ValueError(f"{name}: the daemon's socket {sock} would be "
                         f"{len(os.fsencode(sock))} bytes, over the {SOCKET_PATH_MAX}-byte "
                         f"limit of a Unix socket path (NUL included); choose a shorter "
                         f"runtime dir")
    return path


def check_absolute(path: str, name: str) -> None:
    """Relative paths are refused: every process of a node (DataLoader workers started in
    another working directory, the CLI, the daemon) must name the same directory."""
    if "\0" in path or not os.path.isabs(path):
        raise ValueError(f"{name}: must be an absolute path, got {path!r} (it would "
                         f"depend on each process's working directory)")


def check_seconds(value, name: str, *, zero_ok: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``zero_ok``)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_ok)):
        raise ValueError(f"{name}: must be a finite number of seconds "
                         f"{'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return float(value)


def check_port(value, name: str) -> int | None:
    """A TCP port to listen on: 0..65535 (0: any free port, the one taken is advertised);
    None: none. Strings (from the environment) are parsed."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{name}: expected a port number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name}: must be a port number 0-65535 (0: any free port), "
                         f"got {value!r}")
    return value


def check_trace_dir(value, name: str) -> str | None:
    """Where trace files go: an absolute directory (every process of a job, whatever its
    working directory, must write to the same place); None or "": no tracing."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or "\0" in value or not os.path.isabs(value):
        raise ValueError(f"{name}: must be an absolute directory path, got {value!r}")
    return value


def absolute_or_none(path, name: str) -> str | None:
    """A tier directory, absolute (see check_absolute); None if unset."""
    if path is None or path == "":
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name}: must be an absolute path, got {path!r}")
    check_absolute(os.fspath(path), name)
    return os.fspath(path)


# A variable's string as a number or true/false; empty or unset: None.
def int_or_none(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected a whole number, got {value!r}") from None


def float_or_none(value: str | None, name: str) -> float | None:
    if value is None or value == "":
        return None
    return finite_float(value, f"{name}: ")


def finite_float(value: str | int | float, prefix: str = "") -> float:
    """``value`` as a finite float; a ValueError (its text after ``prefix``) if it is not."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{prefix}expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{prefix}expected a finite number, got {value!r}")
    return number


def bool_or_none(value: str | None, name: str) -> bool | None:
    if value is None or value == "":
        return None
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: expected true/false, got {value!r}")
