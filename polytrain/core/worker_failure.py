"""What the launcher says when a worker fails: the failing rank's own traceback once, short, then one line.

torch's elastic agent logs every failed worker's traceback and then prints its ``ChildFailedError`` box
with the same traceback again: 170 lines for one ``raise`` in a ``training_step``, most of them frames of
torch and polytrain between the launcher and the user's code. Here the rank whose own error ended the
job is found (not a rank that stopped because of it), and its traceback is printed with those frames
left out, the user's file and line kept; ``POLYTRAIN_FULL_ERROR=1`` prints it whole (Hydra's
``HYDRA_FULL_ERROR`` does the same).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import traceback
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from polytrain.core.errors import ConfigError, RankFailedError

FULL_ERROR_ENV = "POLYTRAIN_FULL_ERROR"
# Set by the launcher in the workers that run the user's script again (``relaunch_script``)
SCRIPT_WORKER_ENV = "POLYTRAIN_SCRIPT_WORKER"
# Frames from these directories are the launcher's, the loop's and torch's, not the user's.
_POLYTRAIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LEFT_OUT = tuple(path + os.sep for path in (os.path.dirname(torch.__file__), _POLYTRAIN_DIR))
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+')


def _text_of(failure: Any) -> str:
    message = failure.message
    return str(message.get("message", "") if isinstance(message, dict) else message).strip()


def _first_line(failure: Any) -> str:
    text = _text_of(failure)
    return text.splitlines()[0] if text else f"exit code {failure.exitcode}"


def _is_echo(failure: Any) -> bool:
    return _first_line(failure).startswith(f"{RankFailedError.__name__}:")


def _cause(err: ChildFailedError) -> tuple[int, Any, str]:
    """(rank, its failure, ``Type: message``) of the worker whose own error ended the job.

    A rank that stops because another raised says so with a ``RankFailedError`` holding the other's
    traceback. It may record its error in the same second as the rank that raised (error files carry
    whole seconds) or before it, and the agent may stop the raising rank before it records anything (a
    signal). So: the first rank's own error, else the error an echo carries (its last line). Ties go to
    the lowest rank."""
    in_order = sorted(err.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    # exitcode < 0: stopped by a signal, before it could record an error of its own
    own = [(rank, f) for rank, f in in_order if not _is_echo(f) and f.exitcode >= 0]
    if own:
        rank, failure = own[0]
        return rank, failure, _first_line(failure)
    echoes = [(rank, f) for rank, f in in_order if _is_echo(f)]
    if echoes:
        text = _text_of(echoes[0][1])
        raised = re.search(r"raised on rank (\d+)", text)
        if raised is not None:
            return int(raised.group(1)), echoes[0][1], text.splitlines()[-1].strip()
    rank, failure = in_order[0]
    return rank, failure, _first_line(failure)


def root_cause(err: ChildFailedError) -> str:
    """``rank R: Type: message`` of the worker whose own error ended the job."""
    rank, _, line = _cause(err)
    return f"rank {rank}: {line}"


def _traceback_of(failure: Any) -> str:
    """The traceback the worker recorded (``@record``'s ``py_callstack``), else its message."""
    message = failure.message
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack")
        if stack:
            return str(stack).rstrip()
    return _text_of(failure)


def shorten(traceback_text: str) -> str:
    """``traceback_text`` without torch's and polytrain's frames. A traceback (each of a chain) that would
    keep no frame keeps its last one: where the error was raised."""
    lines = traceback_text.splitlines()
    shown: list[str] = []
    frames: list[tuple[bool, list[str]]] = []  # (left out?, the frame's lines) of the traceback being read

    def keep_frames() -> None:
        kept = [frame for left_out, frame in frames if not left_out]
        if not kept and frames:
            kept = [frames[-1][1]]
        shown.extend(line for frame in kept for line in frame)
        frames.clear()

    i = 0
    while i < len(lines):
        match = _FRAME.match(lines[i])
        if match is None:  # a header, an exception's line, the words between the tracebacks of a chain
            keep_frames()
            shown.append(lines[i])
            i += 1
            continue
        frame, indent = [lines[i]], _indent(lines[i])
        i += 1
        while (i < len(lines) and lines[i].strip() and _indent(lines[i]) > indent
               and not _FRAME.match(lines[i])):
            frame.append(lines[i])  # the frame's source line and its ^^^ markers
            i += 1
        frames.append((match["path"].startswith(_LEFT_OUT), frame))
    keep_frames()
    return "\n".join(shown)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def failure_report(err: ChildFailedError) -> str:
    """The failing rank's traceback, short unless ``POLYTRAIN_FULL_ERROR=1``; the summary line follows it."""
    rank, failure, _ = _cause(err)
    text = _traceback_of(failure)
    if os.environ.get(FULL_ERROR_ENV, "") not in ("", "0"):
        return f"polytrain: rank {rank} failed:\n{text}"
    return (f"polytrain: rank {rank} failed (torch's and polytrain's frames left out; {FULL_ERROR_ENV}=1 "
            f"shows them):\n{shorten(text)}")


def _spawned(err: Exception) -> tuple[str, str]:
    """(``rank R``, its traceback) of ``torch.multiprocessing``'s ``ProcessRaisedException``: the first
    process to end with an error. Where that is a rank stopping for another's (a ``RankFailedError``, which
    carries the other's traceback), the other rank and its own traceback."""
    text = str(err).strip()
    rank = re.search(r"-- Process (\d+) terminated", text)
    stack = text[text.index("Traceback"):] if "Traceback" in text else text
    echo = re.search(rf"{RankFailedError.__name__}: .* raised on rank (\d+), .*?Rank \1's error:\n", stack,
                     re.DOTALL)
    if echo is not None:
        return f"rank {echo.group(1)}", stack[echo.end():]
    return (f"rank {rank.group(1)}" if rank else "a worker"), stack


def spawned_root_cause(err: Exception) -> str:
    """``rank R: Type: message`` of a spawned worker's error, as ``root_cause`` says an elastic worker's."""
    who, stack = _spawned(err)
    return f"{who}: {stack.splitlines()[-1].strip()}"


def spawned_failure_report(err: Exception) -> str:
    """A spawned worker's error (``torch.multiprocessing``'s ``ProcessRaisedException``: its rank, then its
    traceback) as ``failure_report`` says an elastic worker's."""
    who, stack = _spawned(err)
    if os.environ.get(FULL_ERROR_ENV, "") not in ("", "0"):
        return f"polytrain: {who} failed:\n{stack}"
    return (f"polytrain: {who} failed (torch's and polytrain's frames left out; {FULL_ERROR_ENV}=1 shows "
            f"them):\n{shorten(stack)}")


def config_error_said(cause: str) -> str | None:
    """``message (found on rank R)`` where ``cause`` (``rank R: Type: message``, as ``root_cause`` says it) is
    a config error (``ConfigError`` or a kind of it: a class named in the config that only the built module
    can be checked against), for the launcher to say as it says its own; else None."""
    rank, _, error = cause.partition(": ")
    kind, _, message = error.partition(": ")
    if kind.rpartition(".")[2] not in _config_error_names():  # a spawned worker's names its module too
        return None
    return f"{' '.join(message.split())} (found on {rank})"


def _config_error_names() -> set[str]:
    names, pending = set(), [ConfigError]
    while pending:
        kind = pending.pop()
        names.add(kind.__name__)
        pending.extend(kind.__subclasses__())
    return names


def quiet_agent_logs() -> None:
    """Leave out the elastic agent's log of a failed worker (its traceback, and a line for each worker it then
    stops): ``failure_report`` prints the failing rank's traceback once. Only where a failure ends the job:
    with restarts the agent's log is the only word on each failure."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def report_uncaught_to_launcher() -> None:
    """In a worker running the user's script again (the launcher set ``SCRIPT_WORKER_ENV``): an exception
    nothing catches is written to the elastic agent's error file for the launcher to print once, short,
    instead of to this worker's stderr (where every rank's would be followed by the agent's copy). A
    worker without an error file to write prints it as Python would."""
    if os.environ.get(SCRIPT_WORKER_ENV) != "1" or getattr(sys.excepthook, "reports_to_launcher", False):
        return
    previous = sys.excepthook

    def to_launcher(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, KeyboardInterrupt):
            return  # Ctrl-C reached every worker: the launcher says the job was stopped, once
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:
            previous(kind, value, tb)
            return
        # torch's ErrorHandler.record_exception's format (its traceback, from sys.exc_info(), is empty here)
        stack = "".join(traceback.format_exception(kind, value, tb))
        record = {"message": {"message": f"{kind.__name__}: {value}",
                              "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as out:
                json.dump(record, out)
        except OSError:
            previous(kind, value, tb)

    to_launcher.reports_to_launcher = True  # type: ignore[attr-defined]
    sys.excepthook = to_launcher
