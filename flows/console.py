"""The console log handler `lgrpo train`/`rerun` give Prefect when not run with -v (PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS,
Prefect's own override of its logging.yml): error records keep their one-line message but lose the traceback on the
console. The traceback still reaches the run's Prefect API log (the UI) and the run directory's errors/ file, and
the CLI ends a failed run with one line naming the task and the cause (lgrpo_cli.failure_line)."""

from __future__ import annotations

import logging

from prefect.logging.handlers import PrefectConsoleHandler


class BriefConsoleHandler(PrefectConsoleHandler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.exc_text:  # a copy: the API handler formats the same record with its traceback
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                            "msg": record.getMessage(), "args": None})
        super().emit(record)
