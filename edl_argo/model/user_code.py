"""Model errors: failures of the model file's own code, told apart from edl-argo's.

A **model error** is an exception raised inside the model file's code:

* while one of its functions runs, or is traced by TensorFlow: ``custom_model`` (or the function
  ``--model-def`` names), ``feed`` (``dataset_fn``), ``loss``, ``optimizer``, ``eval_metrics_fn``, by the
  names the model flags give them (:func:`model_function` wraps each when the file is loaded);
* while the ops that ``feed`` built run in a worker's input pipeline (e.g. a parse spec that does not match
  the records): the pipeline's only other part, the task stream, never raises
  (:mod:`edl_argo.worker.task_stream`), so the worker marks what the pipeline raises as ``feed``'s.

Anything else is not one: a lost PS, peer or master, a storage outage, a timeout, edl-argo's own code.
Those are retried elsewhere as before; a model error fails the same way wherever it runs, so the job
fails at once (:mod:`edl_argo.worker.main`, :meth:`edl_argo.master.task_dispatcher.TaskDispatcher.report`).

The exception object itself is marked (:func:`mark`), so that it is still found when TensorFlow or Keras
re-raise a reworded copy of it: :func:`model_error_of` follows an exception's ``__cause__``, and its
``__context__`` only when that was suppressed (``raise ... from None``, how both re-raise), never into an
error that merely happened while another was being handled.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

_MARK = "_edl_model_error"
_TF_FUNCTION_NODE = re.compile(r"^\{\{function_node [^}]*\}\}\s*")
#: The first line of an error a traced function raised while it ran, and how the lines that say where (not
#: what) begin: the node's definition, its stack, the node, how many errors.
_GRAPH_EXECUTION_ERROR = "Graph execution error:"
_GRAPH_EXECUTION_CONTEXT = re.compile(r"^(Detected at node|File |\[\[|\d+ root error\(s\) found)")
#: The longest error text a :class:`ModelError` line keeps.
MAX_ERROR_CHARS = 500

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ModelError:
    """Where a model error was raised: the model file (as ``--model-def`` gives it), the function (as the
    file names it) and the error, as one line."""

    source: str
    function: str
    error: str

    def __str__(self) -> str:
        return f"model file {self.source}, function {self.function}: {self.error}"


def mark(error: BaseException, source: str, function: str) -> BaseException:
    """Mark ``error`` as raised in ``function`` of model file ``source`` (unless marked already: the
    innermost function names it); returns ``error``. An exception that takes no attribute stays unmarked,
    and so is retried as any failure."""
    if getattr(error, _MARK, None) is None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, _MARK, ModelError(source, function, error_line(error)))
    return error


def model_function(function: F, source: str, name: str) -> F:
    """``function`` of model file ``source`` (named ``name`` there), whose exceptions are :func:`mark` ed
    and re-raised unchanged."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            raise mark(error, source, name)  # noqa: B904  (the same exception, marked)

    return call  # type: ignore[return-value]


def model_error_of(error: BaseException) -> ModelError | None:
    """The :class:`ModelError` ``error`` is, or replaced (see the module docstring); None if it is not one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = getattr(current, _MARK, None)
        if isinstance(found, ModelError):
            return found
        suppressed = current.__context__ if current.__suppress_context__ else None
        current = current.__cause__ or suppressed
    return None


def error_line(error: BaseException) -> str:
    """``error`` as one line for a report: ``Type: message``; for an error TensorFlow raised while
    tracing the model's code ("in user code: ... ValueError: ..."), the user's error at its end; without
    the ``{{function_node ...}}`` prefix of an error of a TensorFlow op; for an error a traced function
    raised while it ran ("Graph execution error:", where its node was defined, the message, the node), the
    message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0] == "in user code:" and len(lines) > 1:
        return lines[-1][:MAX_ERROR_CHARS]
    if lines and lines[0] == _GRAPH_EXECUTION_ERROR:
        messages = [line for line in lines[1:] if not _GRAPH_EXECUTION_CONTEXT.match(line)]
        lines = messages or lines
    first = _TF_FUNCTION_NODE.sub("", lines[0]) if lines else ""
    return f"{type(error).__name__}: {first}"[:MAX_ERROR_CHARS]
