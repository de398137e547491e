"""Statistical forecasting models, from the library made for them (statsforecast): exponential
smoothing, ARIMA and Theta chosen by information criterion, MSTL for several seasonalities, and
Croston, TSB and ADIDA for intermittent demand (series with many zeros).

Each is a per-series model like the others (per_series.py): `fit` sees one series' training rows and
`predict` forecasts the rows after them. They read only the target, in its own units: their
default `scale` is "none" (a standardised target would hide the level that multiplicative ETS
forms need). The season length comes from the data's frequency (`data.season_length` overrides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.manymodel.models.context import ModelContext

_SEASONALITIES = {"1h": (24, 168), "1d": (7, 365), "1w": (52,), "7d": (52,)}
"""Seasonal periods MSTL fits by default, by data frequency (else the one season length)."""


def _history(frame: pl.DataFrame, target: str) -> np.ndarray:
    """The series' target without its leading gap, inner gaps filled linearly (statsforecast's
    models take no missing values)."""
    column = frame[target]
    if column.dtype == pl.Float64 and not column.has_nulls() and column.len():
        values = column.to_numpy()  # no gap (what most series are): the values as they are
        if not np.isnan(values).any():
            return values.copy()  # writable, the series' own
    y = column.cast(pl.Float64).fill_nan(None)
    y = y.slice(y.is_not_null().arg_true()[0]) if y.null_count() < y.len() else y.clear()
    values = y.interpolate().fill_null(strategy="forward").to_numpy()
    if values.size == 0:
        raise ValueError("the series has no observed values to fit")
    return np.asarray(values, dtype=np.float64)


@dataclass(frozen=True)
class Updated:
    """A fitted statsforecast model and a longer history of its series: it forecasts from the
    end of that history with the parameters it was fitted with (statsforecast's `forward`)."""

    model: Any
    y: np.ndarray


Form = Callable[..., Any]
"""`form(fitted, **args)`: an unfitted statsforecast model in the form a fitted one chose (its
ETS components, ARIMA orders, Theta variant), the user's arguments kept where they apply."""


class Statistical:
    """A statsforecast model fitted per series. `make(season_length, n, **args)` builds an
    unfitted model for a series of `n` observations; `update` carries a fit to a longer history
    without estimating it again (`backtest.refit`); `reestimate` fits the form an earlier fit
    chose to a longer history (`backtest.reselect = false`)."""

    def __init__(
        self,
        context: ModelContext,
        make: Callable[..., Any],
        name: str,
        form: Form | None = None,
        **args: Any,
    ) -> None:
        self.context, self.make, self.form, self.args = context, make, form, args
        try:
            make(context.season_length, 10 * max(context.season_length, 1) + 10, **args)
        except TypeError as e:  # a misspelt argument: say which
            raise ConfigError(f"models.args.{name}: {e}") from None

    def fit(self, frame: pl.DataFrame) -> Any:
        return self._chosen(_history(frame, self.context.target))

    def _chosen(self, y: np.ndarray) -> Any:
        """A fit to the history `y`, its form chosen on it."""
        return self.make(self.context.season_length, y.size, **self.args).fit(y)

    def update(self, fitted: Any, frame: pl.DataFrame) -> Any:
        """The fit carried to the longer history `frame`; fitted again where statsforecast's
        model cannot be carried (Croston, TSB and ADIDA have no `forward`)."""
        model = _fitted_model(fitted)
        if not hasattr(model, "forward"):
            return self.fit(frame)
        return Updated(model, _history(frame, self.context.target))

    def reestimate(self, fitted: Any, frame: pl.DataFrame) -> Any:
        """A fit to `frame` in the form `fitted` chose, its parameters estimated again; the form
        chosen again where the model has none to keep or the rows cannot take it (statsforecast
        refuses a multiplicative one on a series that reached zero)."""
        if self.form is None:
            return self.fit(frame)
        y = _history(frame, self.context.target)
        try:
            return self.form(_fitted_model(fitted), **self.args).fit(y)
        except ValueError:
            return self._chosen(y)

    def predict(self, fitted: Any, frame: pl.DataFrame) -> np.ndarray:
        return np.asarray(_forecast(fitted, frame.height)["mean"], dtype=np.float64)


class WithIntervals(Statistical):
    """A statsforecast model with prediction intervals of its own (`backtest.intervals =
    "model"` uses them)."""

    def predict_interval(
        self, fitted: Any, frame: pl.DataFrame, level: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The model's own interval at `level` percent (ETS, ARIMA, Theta and MSTL have one)."""
        out = _forecast(fitted, frame.height, level=[level])
        return np.asarray(out[f"lo-{level}"]), np.asarray(out[f"hi-{level}"])


def _fitted_model(fitted: Any) -> Any:
    """The statsforecast model of a fit, or of an updated one."""
    return fitted.model if isinstance(fitted, Updated) else fitted


def _forecast(fitted: Any, h: int, **level: Any) -> dict[str, Any]:
    """The next `h` steps of a fit, or of an updated fit from the end of its longer history."""
    if isinstance(fitted, Updated):
        out: dict[str, Any] = fitted.model.forward(y=fitted.y, h=h, **level)
        return out
    predicted: dict[str, Any] = fitted.predict(h=h, **level)
    return predicted


def _seasonal(season: int, n: int) -> int:
    """The season length a model can estimate from `n` observations (two whole seasons), else 1."""
    return season if season > 1 and n >= 2 * season else 1


def _auto_ets(season: int, n: int, **args: Any) -> Any:
    from statsforecast.models import AutoETS

    return AutoETS(season_length=_seasonal(season, n), **args)


def _auto_arima(season: int, n: int, **args: Any) -> Any:
    from statsforecast.models import AutoARIMA

    return AutoARIMA(season_length=_seasonal(season, n), **args)


def _auto_theta(season: int, n: int, **args: Any) -> Any:
    from statsforecast.models import AutoTheta

    return AutoTheta(season_length=_seasonal(season, n), **args)


def _mstl(season: int, n: int, seasonalities: tuple[int, ...] = (), **args: Any) -> Any:
    from statsforecast.models import MSTL, AutoETS

    periods = [s for s in seasonalities if s > 1 and n >= 2 * s]
    if not periods:  # nothing seasonal to remove: the trend model alone
        return AutoETS(season_length=1, model="ZZN")
    return MSTL(season_length=periods, trend_forecaster=AutoETS(model="ZZN"), **args)


def _ets_form(fitted: Any, **args: Any) -> Any:
    from statsforecast.models import AutoETS

    components = fitted.model_["components"]  # error, trend, season, then D for damped
    args = {**args, "model": components[:3], "damped": components[3] == "D"}
    return AutoETS(season_length=fitted.season_length, **args)


def _theta_form(fitted: Any, **args: Any) -> Any:
    from statsforecast.models import AutoTheta

    args = {**args, "model": fitted.model_["modeltype"]}
    return AutoTheta(season_length=fitted.season_length, **args)


def _mstl_form(fitted: Any, seasonalities: tuple[int, ...] = (), **args: Any) -> Any:
    """MSTL of the periods and trend form `fitted` chose (`seasonalities` is `_mstl`'s
    argument, not MSTL's: the periods come from the fit)."""
    from statsforecast.models import MSTL, AutoETS

    if isinstance(fitted, AutoETS):  # there was nothing seasonal to remove
        return _ets_form(fitted)
    trend = _ets_form(fitted.trend_forecaster)
    return MSTL(season_length=fitted.season_length, trend_forecaster=trend, **args)


def _arima_form(fitted: Any, **args: Any) -> Any:
    """ARIMA of the orders and constant AutoARIMA chose (its search arguments no longer apply;
    the Box-Cox ones still do)."""
    from statsforecast.models import ARIMA

    p, q, seasonal_p, seasonal_q, season, d, seasonal_d = fitted.model_["arma"]
    coefficients = fitted.model_["coef"]
    return ARIMA(
        order=(p, d, q),
        season_length=season,
        seasonal_order=(seasonal_p, seasonal_d, seasonal_q),
        include_mean="intercept" in coefficients,
        include_drift="drift" in coefficients,
        **{name: args[name] for name in ("blambda", "biasadj", "method") if name in args},
    )


def _croston(season: int, n: int, **args: Any) -> Any:
    from statsforecast.models import CrostonOptimized

    return CrostonOptimized(**args)


def _tsb(season: int, n: int, alpha_d: float = 0.1, alpha_p: float = 0.1, **args: Any) -> Any:
    from statsforecast.models import TSB

    return TSB(alpha_d=alpha_d, alpha_p=alpha_p, **args)


def _adida(season: int, n: int, **args: Any) -> Any:
    from statsforecast.models import ADIDA

    return ADIDA(**args)


_FORMS: dict[str, Form] = {
    "auto_ets": _ets_form,
    "auto_arima": _arima_form,
    "auto_theta": _theta_form,
    "mstl": _mstl_form,
}
"""How each model that chooses a form by information criterion keeps it; the others (croston,
tsb, adida) have none."""


def _factory(make: Callable[..., Any], name: str) -> Callable[..., Statistical]:
    kind = WithIntervals if name in _FORMS else Statistical

    def build(context: ModelContext, **args: Any) -> Statistical:
        if name == "mstl":  # models.args.mstl = {seasonalities = [24, 168]} overrides
            default = _SEASONALITIES.get(context.freq, (context.season_length,))
            args = {**args, "seasonalities": tuple(args.get("seasonalities", default))}
        return kind(context, make, name, _FORMS.get(name), **args)

    return build


STATISTICAL: dict[str, Callable[..., Statistical]] = {
    name: _factory(make, name)
    for name, make in {
        "auto_ets": _auto_ets,
        "auto_arima": _auto_arima,
        "auto_theta": _auto_theta,
        "mstl": _mstl,
        "croston": _croston,
        "tsb": _tsb,
        "adida": _adida,
    }.items()
}
"""The built-in statistical models by name."""
