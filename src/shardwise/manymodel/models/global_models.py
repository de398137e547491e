"""Global models (`models.global.<name> = true`): one model fitted on the rows of every series at
once, in each backtest window and for the forecast, instead of one model per series.

The series stay spread over Ray actors, one per task slot (`runner.global_workers` caps them),
each holding whole series. For each window, every actor takes its series' rows before their
origin (the same origins as the per-series backtest), under the model's target transform fitted
per series (transforms.py), and then:
- a model whose `fit` takes a `group` (group.py) is fitted on every actor at once, each on its
  own rows: LightGBM trains data-parallel over its sockets, the MLP sums its gradients over gloo;
- any other model is fitted once, on every actor's rows gathered to the first.
Each actor then forecasts its own series, and the forecasts (in the target's units) go to the
chunk tasks, which score, select and refit around them like any model's (`backtest.Given`). A
window that `backtest.refit` does not refit is forecast with the last fit.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import polars as pl

from shardwise.manymodel.columns import FUTURE, SERIES
from shardwise.manymodel.evaluation.backtest import Plan, failure_message, origins
from shardwise.manymodel.models.group import Group
from shardwise.manymodel.models.per_series import as_values, build
from shardwise.manymodel.models.transforms import TARGET

GIVEN_SCHEMA: dict[str, Any] = {
    SERIES: pl.Int64,
    "model": pl.String,
    "origin": pl.Int64,
    "step": pl.Int64,
    "forecast": pl.Float64,
    "error": pl.String,
}
"""The forecasts of the global models: per series, model and origin (the rows it was fitted on;
the number of observed rows for the final forecast), one row per step; `error` when the fit
failed."""


class Worker:
    """One Ray actor's part of the series, and the fits it takes part in."""

    def __init__(self, plan: Plan, rank: int, size: int, *chunks: Any) -> None:
        frame = pl.concat([c if isinstance(c, pl.DataFrame) else _frame(c) for c in chunks])
        if plan.columns.target != TARGET:
            frame = frame.rename({plan.columns.target: TARGET})
        self.plan, self.rank, self.size = plan, rank, size
        self.series = frame.partition_by(SERIES, maintain_order=True)
        self.group = Group(rank, size)
        self.fitted: Any = None

    def endpoint(self) -> tuple[str, int, int]:
        """This actor's address and two free ports (LightGBM's, torch.distributed's)."""
        import ray

        host: str = ray.util.get_node_ip_address()
        return host, _free_port(host), _free_port(host)

    def rows(self, label: str, window: int) -> pl.DataFrame:
        """This actor's training rows for `window` (n_windows: the final fit), transformed."""
        parts: list[pl.DataFrame] = [train for train, _, _ in self._windows(label, window)]
        return pl.concat(parts, how="diagonal")

    def fit(
        self,
        label: str,
        window: int,
        gathered: list[Any] | None = None,
        endpoints: list[tuple[str, int, int]] | None = None,
    ) -> Any:
        """Fit on this actor's rows (with the group of `endpoints`, when the model takes one:
        every actor calls this at once, with fresh ports each time, as LightGBM binds its port
        anew for every fit), or on `gathered` rows (object refs of every actor's `rows`). The
        fitted model is kept for `predict`; a fit on gathered rows also returns it."""
        from shardwise.manymodel.run.limits import one_thread

        name, args = self._model(label)
        model = build(name, args, self.plan.context)
        with one_thread(torch_too=name == "mlp"):
            if gathered is not None:
                import ray

                self.fitted = model.fit(pl.concat(ray.get(gathered), how="diagonal"))
                return self.fitted
            rows = self.rows(label, window)
            if endpoints:
                self.group = Group(self.rank, self.size, tuple(endpoints))
            if takes_group(model):
                with _quiet_stdout():  # LightGBM prints every socket it binds and connects
                    self.fitted = model.fit(rows, group=self.group)  # type: ignore[call-arg]
            else:
                self.fitted = model.fit(rows)
        return None

    def predict(self, label: str, window: int, fitted: Any = None) -> pl.DataFrame:
        """Forecast this actor's series for `window` with `fitted` (or the model it fitted last:
        a window that `backtest.refit` does not refit forecasts with an earlier window's)."""
        from shardwise.manymodel.run.limits import one_thread

        name, args = self._model(label)
        model = build(name, args, self.plan.context)
        fitted = self.fitted if fitted is None else fitted
        parts = self._windows(label, window)
        frame = pl.concat([rows for _, rows, _ in parts], how="diagonal")
        with one_thread(torch_too=name == "mlp"):
            values = as_values(model.predict(fitted, frame), frame.height, label)
        out: list[tuple[Any, ...]] = []
        start = 0
        for _, rows, (series, origin, back) in parts:
            predicted = back(values[start : start + rows.height])
            start += rows.height
            out.extend(
                (series, label, origin, k + 1, float(v), None) for k, v in enumerate(predicted)
            )
        return pl.DataFrame(out, schema=GIVEN_SCHEMA, orient="row")

    def failed(self, label: str, window: int, error: str) -> pl.DataFrame:
        """The rows that tell this actor's series the fit for `window` failed."""
        out = [
            (series, label, origin, 0, None, error)
            for _, _, (series, origin, _) in self._windows(label, window, transform=False)
        ]
        return pl.DataFrame(out, schema=GIVEN_SCHEMA, orient="row")

    def _model(self, label: str) -> tuple[str, dict[str, Any]]:
        return next((name, args) for lab, name, args in self.plan.models if lab == label)

    def _windows(self, label: str, window: int, *, transform: bool = True) -> list[Any]:
        """Per series: training rows, rows to forecast, and (series, origin, undo-transform)."""
        plan, out = self.plan, []
        for frame in self.series:
            observed = frame.filter(~pl.col(FUTURE))
            n = observed.height
            if window < plan.n_windows:
                origin = origins(n, plan)[window]
                train, rows = observed.head(origin), observed.slice(origin, plan.horizon)
            else:
                origin, train = n, observed
                rows = frame.filter(pl.col(FUTURE))
            rows = rows.drop(TARGET)
            back: Any = None
            if transform:
                train, rows, back = plan.transforms[label].apply(train, rows)
            out.append((train, rows, (int(frame[SERIES][0]), origin, back)))
        return out


def takes_group(model: Any) -> bool:
    """Whether a model fits with a group of workers, each on its own rows (group.py)."""
    return "group" in inspect.signature(model.fit).parameters


def fit_global(
    ray: Any, plan: Plan, chunk_refs: list[Any], workers: int, num_cpus: float
) -> pl.DataFrame:
    """Every global model's forecasts for every window and the final fit (GIVEN_SCHEMA), with
    the series of `chunk_refs` (object refs of the chunks) spread over `workers` actors of
    `num_cpus` each (a task's share: `workers` is at most the task slots, so all of them fit)."""
    size = max(1, min(workers, len(chunk_refs)))
    actor = ray.remote(Worker).options(num_cpus=num_cpus)
    actors = [actor.remote(plan, rank, size, *chunk_refs[rank::size]) for rank in range(size)]
    try:
        parts: list[pl.DataFrame] = []
        for label, name, args in plan.models:
            if label not in plan.global_models:
                continue
            together = size == 1 or takes_group(build(name, args, plan.context))
            fit = _Fit(label, together)
            for window in range(plan.n_windows + 1):
                parts.extend(fit.window(ray, actors, window, refit=plan.refits(window)))
        return pl.concat(parts) if parts else pl.DataFrame(schema=GIVEN_SCHEMA)
    finally:
        for a in actors:
            ray.kill(a)


class _Fit:
    """One global model's fits, window after window: a window `backtest.refit` does not refit
    forecasts with the last fit (kept by every actor, or by the driver as an object ref when
    fitted on gathered rows), and fails as that fit did."""

    def __init__(self, label: str, together: bool) -> None:
        self.label, self.together = label, together
        self.fitted: Any = None
        self.error = ""

    def window(
        self, ray: Any, actors: list[Any], window: int, *, refit: bool
    ) -> list[pl.DataFrame]:
        """Every actor's forecasts of its series for `window`, after fitting when `refit`."""
        if refit:
            self.error, self.fitted = "", None
            try:
                self._fit(ray, actors, window)
            except ray.exceptions.RayTaskError as e:
                self.error = _message(e)
        if self.error:  # the fit this window forecasts with failed
            return self._failed(ray, actors, window, self.error)
        try:
            frames: list[pl.DataFrame] = ray.get(
                [a.predict.remote(self.label, window, self.fitted) for a in actors]
            )
            return frames
        except ray.exceptions.RayTaskError as e:
            return self._failed(ray, actors, window, _message(e))

    def _fit(self, ray: Any, actors: list[Any], window: int) -> None:
        if self.together:
            endpoints = ray.get([a.endpoint.remote() for a in actors])
            ray.get([a.fit.remote(self.label, window, None, endpoints) for a in actors])
        else:  # fitted when predict needs it: a failure shows there
            rows = [a.rows.remote(self.label, window) for a in actors]
            self.fitted = actors[0].fit.remote(self.label, window, rows)

    def _failed(self, ray: Any, actors: list[Any], window: int, error: str) -> list[pl.DataFrame]:
        return ray.get([a.failed.remote(self.label, window, error) for a in actors])  # type: ignore[no-any-return]


def _message(error: Exception) -> str:
    cause = getattr(error, "cause", None)
    return failure_message(cause if isinstance(cause, BaseException) else error)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send this process's standard output (file descriptor 1, as C++ code writes it) to
    /dev/null; errors still reach standard error and exceptions."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _frame(table: Any) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
