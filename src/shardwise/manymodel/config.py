"""The many-models job file: data, features, models, backtest, runner, tracking.

Like the training job file it is TOML validated by pydantic, with `--set a.b=value` overrides and
one-line errors (`common/job_files.py` does the loading). Checks that need only the config, such as
a lag shorter than the forecast horizon, happen here; checks that need the data (missing columns,
duplicate rows, short series) happen when the data is read.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import RunName, Section, load_job_file

BUILTIN_SOURCES = ("us_employment", "retail_synthetic")
STATISTICAL_MODELS = ("auto_ets", "auto_arima", "auto_theta", "mstl", "croston", "tsb", "adida")
"""statsforecast's models (manymodel/models/statistical.py): they read the target only, unscaled."""
TARGET_ONLY_MODELS = ("seasonal_naive", *STATISTICAL_MODELS)
"""Models that read the target alone: no feature is computed for a job of only these."""
BUILTIN_MODELS = ("seasonal_naive", "ridge", "lightgbm", "mlp", *STATISTICAL_MODELS)
MAX_SYNTHETIC_ROWS = 100_000_000
"""`retail_synthetic` builds its table at once: this many rows take several GiB."""
Stat = Literal["mean", "std", "min", "max"]
CalendarPart = Literal[
    "year", "quarter", "month", "week", "day_of_week", "day_of_month", "day_of_year", "hour"
]
FREQ = re.compile(r"([1-9][0-9]*)(ns|us|ms|s|m|h|d|w|mo|q|y)")
"""A spacing: one positive count of one polars duration unit (compound spacings such as `1d12h`
cannot be multiplied into the k-step offsets of the future rows)."""


class JobSection(Section):
    """The run: its name, its seed and where its results go."""

    name: RunName = "many-models"
    """Names the run (`runs/<name>`), its MLflow run and, by default, its MLflow experiment:
    letters, digits, `.`, `_` and `-`, not only dots."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds the generated `retail_synthetic` data, lightgbm's and mlp's fits, and the sample of
    series the plots draw: 0 to 2**32 - 1."""
    run_dir: str = ""
    """Where the chunk results, output tables and tracking store go; "" means `runs/<name>`."""


class DataSection(Section):
    """The long table of series, one row per series and timestamp: where it comes from, which
    columns name a series, hold its time, its target and its covariates, and its spacing."""

    source: str = "us_employment"
    """A built-in data set (`us_employment`: the 148 monthly US employment series of fpp3;
    `retail_synthetic`: generated store × item demand) or a CSV/Parquet path or fsspec URL."""
    id_columns: list[str] = Field(default_factory=list)
    """Columns that together name a series; built-in sources set them."""
    timestamp: str = ""
    """The column of each row's date or time (text is parsed); built-in sources set it, a file
    needs it."""
    target: str = ""
    """The numeric column to forecast; rows after a series' last value with it empty are the
    future (they carry its covariates). Built-in sources set it, a file needs it."""
    covariates: list[str] = Field(default_factory=list)
    """Numeric columns known in advance (prices, promotions). For the forecast, their future
    values come from rows after a series' last target that have the target empty."""
    freq: str = ""
    """Spacing of the timestamps as a polars duration (`1mo`, `3mo`, `1w`, `1d`, `1h`); ""
    infers it from the data."""
    season_length: int = Field(0, ge=0)
    """Steps per season (seasonal naive, MASE); 0 derives it from the frequency (12 for
    monthly, 7 for daily, …)."""
    num_series: int = Field(0, ge=0)
    """How many series to use (the first ones by id) or, for `retail_synthetic`, to generate;
    0 means all (synthetic: 1000)."""
    periods: int = Field(156, gt=0)
    """`retail_synthetic`: weeks per series."""

    @field_validator("freq")
    @classmethod
    def _duration(cls, value: str) -> str:
        if value and not FREQ.fullmatch(value):
            raise ValueError(
                "expected a positive count and a unit, e.g. 1mo, 3mo, 1w, 1d or 1h (units: ns, "
                'us, ms, s, m, h, d, w, mo, q, y), or "" to infer it from the data'
            )
        return value


class FeaturesSection(Section):
    """The features computed from each series for the models that read features (ridge,
    lightgbm, mlp, user models): lags, rolling and expanding statistics, calendar parts and
    group statistics, what computes them, and how the target is scaled."""

    backend: Literal["polars", "spark"] = "polars"
    """What computes the features: `polars` in this process, or `spark` (its own window
    functions), with the same result bit for bit; `--features-backend` sets it."""
    spark_master: str = "local[*]"
    """`backend = "spark"`: the Spark master, e.g. `local[*]` (Spark in this machine, on every
    core) or `spark://host:7077`; `--spark-master` sets it."""
    lags: list[int] = Field(default_factory=list)
    """Target lags as features; default: horizon … horizon + season_length − 1."""
    window_shift: int = Field(0, ge=0)
    """Rolling, expanding and group features summarise the target shifted by this many steps;
    0 means the horizon, the smallest shift that is known for every forecast step."""
    rolling_windows: list[int] = Field(default_factory=list)
    """Rolling windows, in steps: for each w, the `rolling_stats` of the last w values of the
    shifted target (columns `roll<w>_<stat>`); empty: none."""
    rolling_stats: list[Stat] = Field(default_factory=lambda: ["mean"])  # type: ignore[arg-type]
    """The statistics of each rolling window: mean, std, min, max."""
    expanding_stats: list[Stat] = Field(default_factory=list)
    """Statistics of all of a series' shifted target up to each row (columns
    `expanding_<stat>`): mean, std, min, max; empty: none."""
    calendar: list[CalendarPart] = Field(default_factory=list)
    """Parts of each row's timestamp as features (`cal_<part>`; a zoned timestamp's in its
    zone; day_of_week: Monday = 1): ridge and mlp one-hot encode them, lightgbm reads the
    numbers."""
    group_by: list[list[str]] = Field(default_factory=list)
    """Group aggregations: for each list of columns (e.g. ["store"]), the `group_stats` over all
    series in the group at the same timestamp of their shifted target."""
    group_stats: list[Stat] = Field(default_factory=lambda: ["mean"])  # type: ignore[arg-type]
    """The statistics of each `group_by` group: mean, std, min, max."""
    scale: Literal["none", "mean", "standard"] = "standard"
    """Per-series target scaling, fitted on each training window only: divide by the mean
    absolute value, or standardise. Target-derived features are transformed alike."""

    @model_validator(mode="after")
    def _positive(self) -> FeaturesSection:
        for key in ("lags", "rolling_windows"):
            bad = [v for v in getattr(self, key) if v < 1]
            if bad:
                raise ValueError(f"features.{key} must be positive, got {bad[0]}")
        return self


class ModelsSection(Section):
    """The models fitted to every series, and per model: its arguments, how its target is
    scaled, whether it is differenced, and whether it is one global model."""

    names: list[str] = Field(default_factory=lambda: ["seasonal_naive", "ridge"])
    """Built-in models (`seasonal_naive`, `ridge`, `lightgbm`, `mlp`; statsforecast's
    `auto_ets`, `auto_arima`, `auto_theta`, `mstl`, and for intermittent demand `croston`, `tsb`,
    `adida`) and user models as an importable module or `module:object` with `fit(frame)` and
    `predict(fitted, frame)`."""
    args: dict[str, dict[str, object]] = Field(default_factory=dict)
    """Keyword arguments per model name, e.g. args.lightgbm = {n_estimators = 50}."""
    scale: dict[str, Literal["none", "mean", "standard"]] = Field(default_factory=dict)
    """Target scaling per model name, e.g. scale.ridge = "mean"; a model not named here gets
    `features.scale`, except the statistical models and seasonal naive, which get "none" (they
    model the level; a seasonal naive forecast repeats values, which scaling would only round)."""
    difference: dict[str, bool] = Field(default_factory=dict)
    """difference.lightgbm = true: the model predicts the target minus its smallest lag (the
    value `horizon` steps earlier, by default), and level features are taken relative to it, so
    trees follow trends (manymodel/models/transforms.py). Feature models and user models only."""
    global_: dict[str, bool] = Field(default_factory=dict, alias="global")
    """global.lightgbm = true: one model fitted on every series' rows at once in each backtest
    window (and for the forecast) instead of one per series, trained on Ray workers that each
    hold a part of the series (manymodel/models/global_models.py). Feature models and user
    models."""


class BacktestSection(Section):
    """The rolling-origin backtest that scores every model on every series, how the forecasts'
    model is chosen from its scores, how often models are refitted, and prediction intervals."""

    horizon: int = Field(12, gt=0)
    """Steps forecast, in each backtest window and into the future; no feature reads a value
    less than this many steps old."""
    n_windows: int = Field(2, gt=0)
    """Backtest windows (forecast origins) per series, `step` apart, the last one `horizon`
    steps before the series' last value: every model forecasts each window, scored against the
    actual values."""
    step: int = Field(0, ge=0)
    """Steps between successive forecast origins; 0 means the horizon."""
    metric: Literal["mase", "smape", "mae", "rmse"] = "mase"
    """The metric (mean over windows) that picks each series' model."""
    ensemble_top_k: int = Field(0, ge=0)
    """k ≥ 2 adds an ensemble per series: the mean forecast of its k best models."""
    levels: list[int] = Field(default_factory=list)
    """Prediction intervals at these levels in percent, e.g. [80, 95]: conformal, from the
    backtest windows' errors (no extra fits), pooled across series; scored on later windows
    (coverage, Winkler, MSIS) and written as `lo_80`, `hi_80`, … columns of the forecasts, null
    where the level cannot be honoured (manymodel/evaluation/intervals.py)."""
    intervals: Literal["auto", "pooled", "series", "model"] = "auto"
    """Where the intervals' errors come from: `pooled` (every series' errors, each divided by
    its series' seasonal naive MAE, per model and step), `series` (each series' own: 19 windows
    for 95%), `auto` (whichever of the two scores better on the earlier windows), `model` (the
    intervals of models that have their own: auto_ets, auto_arima, auto_theta, mstl, pooled ones
    for the rest)."""
    selection: Literal["auto", "per_series", "ensemble", "best_model"] = "auto"
    """What the forecasts use: each series' best model, its ensemble, or the one model best over
    all series. `auto` picks whichever scores best on the windows after the first, each chosen
    on the windows before it (nested: needs n_windows ≥ 2; with one window, per_series)."""
    min_train: int = Field(0, ge=0)
    """Fewest training rows with complete features in the earliest window; 0 means
    max(2 × season_length, 10). Shorter series are skipped and listed."""
    refit: bool | int = True
    """Which fits re-estimate a model, as statsforecast's cross-validation counts them, the
    forecast being the window after the last: true, every window's and the forecast's; k, those
    of windows 0, k, 2k, …; false, the first window's only. The others keep the last fit's
    parameters and run its state through the longer history (statsforecast's `forward`): one fit
    per series instead of n_windows + 1. Models on features (ridge, lightgbm, mlp, per series
    or global) forecast with their last fit as it is; user models without `update` are fitted
    every time."""

    reselect: bool = True
    """false: a model that chooses its form by information criterion (auto_ets's error, trend
    and season; auto_arima's orders and constant; auto_theta's variant; mstl's trend model)
    chooses it on the first window only, and every later fit that re-estimates (`refit`)
    estimates that form's parameters again: 2.5-42× cheaper fits. A form the later rows cannot take
    (multiplicative, on a series that reached zero) is chosen again; models without a form, and
    user models without `reestimate`, are fitted as usual."""

    @field_validator("refit", mode="before")
    @classmethod
    def _windows_between_fits(cls, refit: object) -> bool | int:
        if isinstance(refit, bool) or (isinstance(refit, int) and refit >= 0):
            return refit
        raise ValueError(
            "is true, false (or 0) or how many windows apart models are re-estimated (≥ 1)"
        )

    @field_validator("levels")
    @classmethod
    def _percentages(cls, levels: list[int]) -> list[int]:
        bad = [level for level in levels if not 0 < level < 100]
        if bad:
            raise ValueError(f"levels are percentages between 0 and 100, got {bad[0]}")
        return levels


Reconciler = Literal[
    "bottom_up", "top_down", "mint_ols", "mint_wls_struct", "mint_wls_var", "mint_shrink"
]

DEFAULT_RECONCILERS: tuple[Reconciler, ...] = (
    "bottom_up", "top_down", "mint_ols", "mint_wls_struct", "mint_shrink"
)  # fmt: skip


class HierarchySection(Section):
    """Hierarchical forecasting: the aggregation levels whose sums become series too, and the
    reconcilers that make the forecasts add up; empty `levels`: none."""

    levels: list[list[str]] = Field(default_factory=list)
    """Aggregation levels from the top, each a list of id columns, e.g. [["state"], ["state",
    "region"]]: each level's sums of the bottom series (data.id_columns) become series too, as
    does the total. Every series is forecast, then the forecasts are reconciled so they add up
    (manymodel/hierarchy/levels.py)."""
    methods: list[Reconciler] = Field(default_factory=lambda: list(DEFAULT_RECONCILERS))
    """hierarchicalforecast's reconcilers: BottomUp, TopDown (average historical proportions),
    MinTrace with OLS or structural (wls_struct) weights, or weighted by the backtest errors'
    variances (wls_var) or shrunk covariance (mint_shrink)."""


class RunnerSection(Section):
    """The tasks the series are forecast in: where they run (worker processes on this machine,
    or Ray), the resources each task reserves, how many series a task takes, the workers of
    global models, and retries."""

    backend: Literal["auto", "local", "ray"] = "auto"
    """Where the chunks of series run: `local` in worker processes on this machine (in this
    process where one task at a time fits on the cores), `ray` on Ray; `auto` takes Ray for
    a cluster (`ray_address`), a Ray the caller started, global models or GPUs, else local
    (a local Ray would cost its start and its processes' time: manymodel/run/local_tasks.py)."""
    ray_address: str = ""
    """"" starts a local Ray instance; `auto` or `ray://host:port` joins a cluster."""
    num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per task; fractions (0.25) let more tasks share a core (locally: as many
    worker processes as the cores hold)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per task; fractions (0.25) let more tasks share a GPU. The built-in models
    run on the CPU: this is for user models that use a GPU."""
    memory_mb: int = Field(0, ge=0)
    """Address-space cap per task in MiB, enforced in the worker; a series that exceeds it
    fails with MemoryError, the rest go on. 0: no cap."""
    chunk_size: int = Field(0, ge=0)
    """Series per task; 0 picks one that gives every task slot several chunks."""
    global_workers: int = Field(0, ge=0)
    """Ray actors that fit each global model together, each holding a part of the series; 0
    means one per task slot."""
    max_retries: int = Field(3, ge=0)
    """Times a task (a chunk, or a part of one of the last) whose worker process died runs again
    on a new one."""


class TrackingSection(Section):
    """MLflow tracking and plots of the run; the output tables are written to the run directory
    either way."""

    mlflow: bool = True
    """Record the run in MLflow: the config, overall and per-model metrics, the output tables
    (and the plots) as artifacts; false: the run directory only."""
    plots: bool = False
    """Draw `<run_dir>/plots/` (MASE per model; history, forecast and intervals of a sample of
    series and of the worst ones) and log them to MLflow; `--plot` sets it."""
    uri: str = ""
    """MLflow tracking URI; "" means an embedded SQLite store `<run_dir>/mlflow.db`."""
    experiment: str = ""
    """MLflow experiment name; "" means the job name."""
    registered_model: str = ""
    """Register the run's result in MLflow's Model Registry under this name: one pyfunc whose
    `predict` takes series ids (and the parameter `horizon`) and returns the chosen forecasts
    with their intervals (docs/serving.md); needs `mlflow = true`."""

    @field_validator("registered_model")
    @classmethod
    def _needs_mlflow(cls, name: str, info: ValidationInfo) -> str:
        if name and not info.data.get("mlflow", True):
            raise ValueError(
                "registers the run in MLflow, which tracking.mlflow = false turns off; set "
                "tracking.mlflow = true"
            )
        return name


class ManyModelsConfig(Section):
    """A whole many-models job file; the Python API takes the same object."""

    job: JobSection = JobSection()
    data: DataSection = DataSection()
    features: FeaturesSection = FeaturesSection()
    models: ModelsSection = ModelsSection()
    backtest: BacktestSection = BacktestSection()
    hierarchy: HierarchySection = HierarchySection()
    runner: RunnerSection = RunnerSection()
    tracking: TrackingSection = TrackingSection()

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir or f"runs/{self.job.name}")

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"

    @property
    def window_shift(self) -> int:
        return self.features.window_shift or self.backtest.horizon

    @property
    def reads_features(self) -> bool:
        """Whether a model of the job reads the computed features (lags, windows, calendar
        parts): seasonal naive and statsforecast's models read the target only, user models
        may read anything."""
        return any(name not in TARGET_ONLY_MODELS for name in self.models.names)

    @property
    def backtest_step(self) -> int:
        return self.backtest.step or self.backtest.horizon

    @property
    def refit_every(self) -> int:
        """`backtest.refit` as windows between fits: 1 (true), k, or 0 (false: the first only)."""
        refit = self.backtest.refit
        return int(refit) if isinstance(refit, bool) else refit


def check(config: ManyModelsConfig) -> None:
    """Cross-section checks that need no data."""
    horizon = config.backtest.horizon
    short = [lag for lag in config.features.lags if lag < horizon]
    if short:
        raise ConfigError(
            f"features.lags contains {short[0]} but backtest.horizon is {horizon}: a lag shorter "
            f"than the horizon reads values not yet known {horizon} steps ahead; use lags ≥ "
            f"{horizon}"
        )
    if config.features.window_shift and config.features.window_shift < horizon:
        raise ConfigError(
            f"features.window_shift = {config.features.window_shift} is shorter than "
            f"backtest.horizon = {horizon}; use ≥ {horizon} or 0 (the horizon)"
        )
    if config.data.source == "retail_synthetic":
        _check_synthetic(config)
    _check_roles(config.data)
    _check_models(config)
    if config.hierarchy.levels and not config.hierarchy.methods:
        raise ConfigError(
            f"hierarchy.methods is empty; name a reconciler: {', '.join(get_args(Reconciler))}"
        )


def _check_roles(data: DataSection) -> None:
    """Each column has one role: the same name twice would be one column read twice."""
    if data.target and data.target == data.timestamp:
        raise ConfigError(
            f"data.target names '{data.target}', which is data.timestamp; a column has one role"
        )
    earlier = {data.timestamp: "data.timestamp", data.target: "data.target"}
    for key, names in (("id_columns", data.id_columns), ("covariates", data.covariates)):
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"data.{key} names '{name}' twice; name each column once")
            if name in earlier:
                raise ConfigError(
                    f"data.{key} names '{name}', which is {earlier[name]}; a column has one role"
                )
        earlier.update(dict.fromkeys(names, "one of data.id_columns"))


def _check_models(config: ManyModelsConfig) -> None:
    names = config.models.names
    if not names:
        raise ConfigError("models.names is empty; name at least one model, e.g. ['ridge']")
    for name in names:
        if name not in BUILTIN_MODELS and "." not in name and ":" not in name:
            raise ConfigError(
                f"unknown model '{name}'; built-in models are {', '.join(BUILTIN_MODELS)}, "
                "or give a user model as an importable module path (package.module)"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"models.names lists a model twice: {names}")
    labels = [model_label(n) for n in names]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        same = [n for n in names if model_label(n) == twice[0]]
        raise ConfigError(
            f"models.names: {' and '.join(same)} would both be called '{twice[0]}' in the "
            "results; name one with module:object under another name"
        )
    reserved = sorted({model_label(n) for n in names} & {"selected", "ensemble"})
    if reserved:
        raise ConfigError(
            f"a model may not be called '{reserved[0]}' (the backtest's name for its held-out "
            "choice); rename it"
        )
    backtest = config.backtest
    if backtest.selection == "ensemble" and backtest.ensemble_top_k < 2:
        raise ConfigError(
            "backtest.selection = 'ensemble' needs backtest.ensemble_top_k ≥ 2 (the models "
            "each series' ensemble averages)"
        )
    _check_model_options(config)


def _check_model_options(config: ManyModelsConfig) -> None:
    """`models.args`, `.scale`, `.difference`, `.global` name models that can take them."""
    known = {*BUILTIN_MODELS, *(model_label(n) for n in config.models.names)}
    for key in ("args", "scale", "difference", "global"):
        unknown = sorted(set(getattr(config.models, key.replace("global", "global_"))) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = (
                f"; did you mean '{close[0]}'?"
                if close
                else f"; models: {', '.join(sorted(known))}"
            )
            raise ConfigError(f"models.{key}.{unknown[0]} names no model{hint}")
    level_only = {"seasonal_naive", *STATISTICAL_MODELS}
    for key, what in (("difference", "differenced"), ("global", "fitted across series")):
        named = getattr(config.models, key.replace("global", "global_"))
        bad = sorted(name for name, on in named.items() if on and name in level_only)
        if bad:
            raise ConfigError(
                f"models.{key}.{bad[0]}: {bad[0]} models each series' own values, it cannot be "
                f"{what}; set it for feature models (ridge, lightgbm, mlp) or user models"
            )


def _check_synthetic(config: ManyModelsConfig) -> None:
    """The generated table must fit the backtest and memory (it is built whole, in numpy)."""
    horizon, periods = config.backtest.horizon, config.data.periods
    if horizon >= periods:
        raise ConfigError(
            f"backtest.horizon = {horizon} is not shorter than the synthetic series (data.periods "
            f"= {periods} weeks); lower backtest.horizon or raise data.periods"
        )
    rows = (config.data.num_series or 1000) * (periods + horizon)
    if rows > MAX_SYNTHETIC_ROWS:
        raise ConfigError(
            f"retail_synthetic with data.num_series × (data.periods + backtest.horizon) = {rows:,} "
            f"rows is more than the generator makes ({MAX_SYNTHETIC_ROWS:,}); lower "
            "data.num_series or data.periods"
        )


def model_scale(config: ManyModelsConfig, name: str) -> str:
    """How the target is scaled for model `name` (see ModelsSection.scale)."""
    label = model_label(name)
    default = "none" if name in TARGET_ONLY_MODELS else config.features.scale
    return config.models.scale.get(label, default)


def model_differenced(config: ManyModelsConfig, name: str) -> bool:
    return config.models.difference.get(model_label(name), False)


def model_global(config: ManyModelsConfig, name: str) -> bool:
    return config.models.global_.get(model_label(name), False)


def model_label(name: str) -> str:
    """The name a model has in the output tables: built-in name or the user path's last part."""
    return name.replace(":", ".").rsplit(".", 1)[-1] if name not in BUILTIN_MODELS else name


def load_many_models(
    path: str | Path, overrides: list[str] | tuple[str, ...] = ()
) -> ManyModelsConfig:
    """Read and check a many-models job file."""
    config = load_job_file(path, overrides, ManyModelsConfig)
    check(config)
    return config
