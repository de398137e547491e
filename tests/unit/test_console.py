"""Warnings read like errors (issue 35): shardwise's own print as one line,
`shardwise: warning: …`, with no file path and no source line; others as Python prints them."""

from __future__ import annotations

import warnings

from shardwise.common.console import ShardwiseWarning, one_line_warnings, warn


def test_a_shardwise_warning_is_one_line_without_file_or_source(capsys):
    with warnings.catch_warnings(), one_line_warnings():
        warnings.simplefilter("always")
        warn("skipping checkpoint step_00000040: a file is missing; resuming from step_00000030")
    err = capsys.readouterr().err
    assert err == (
        "shardwise: warning: skipping checkpoint step_00000040: a file is missing; resuming from "
        "step_00000030\n"
    )


def test_other_warnings_go_where_they_went(capsys):
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *rest: seen.append(category)
        with one_line_warnings():
            warnings.warn("a library's", DeprecationWarning, stacklevel=1)
    assert seen == [DeprecationWarning] and capsys.readouterr().err == ""
    assert issubclass(ShardwiseWarning, UserWarning)
