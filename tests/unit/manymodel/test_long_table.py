"""Reading the long table: column roles, frequency, future rows, and one-line errors."""

from __future__ import annotations

import math
import socket
import threading
from datetime import date

import polars as pl
import pytest

import helpers
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import FUTURE, SERIES
from shardwise.manymodel.config import ManyModelsConfig, check
from shardwise.manymodel.data.long_table import load_series


def config(source, **sections) -> ManyModelsConfig:
    raw = {
        "data": {
            "source": str(source),
            "id_columns": ["shop"],
            "timestamp": "day",
            "target": "units",
        },
        "backtest": {"horizon": 3, "n_windows": 2, "min_train": 5},
        "features": {"lags": [3, 4]},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return validate_as(ManyModelsConfig, raw)


def write_csv(tmp_path, rows) -> str:
    path = tmp_path / "sales.csv"
    pl.DataFrame(rows, orient="row", schema=["shop", "day", "units"]).write_csv(path)
    return str(path)


def daily(shop: str, days: int, start: int = 1) -> list[tuple[str, str, float]]:
    return [(shop, f"2024-01-{d:02d}", float(d)) for d in range(start, start + days)]


def test_reads_a_csv_infers_daily_and_appends_future_rows(tmp_path):
    source = write_csv(tmp_path, daily("a", 20) + daily("b", 25))
    table = load_series(config(source))
    assert table.freq == "1d" and table.season_length == 7
    assert table.num_series == 2
    future = table.frame.filter(pl.col(FUTURE))
    assert future.group_by("shop").len().sort("shop")["len"].to_list() == [3, 3]
    last_a = future.filter(pl.col("shop") == "a")["day"].max()
    assert last_a == date(2024, 1, 23)
    assert future["units"].null_count() == 3 * 2
    assert table.frame[SERIES].unique().sort().to_list() == [0, 1]


def test_series_are_numbered_in_the_ids_text_order_whatever_the_rows_order(tmp_path):
    """Each series' number is its rank in the id columns' text order (`"10" < "9"`, capitals
    first, accents after), its rows carry its own ids, and nothing else moves: the table equals
    the one sorting by the id strings gives."""
    rows = []
    for region in ("west", "East", "éa"):
        for shop in ("9", "10", "b"):
            rows += [(region, shop, day, units) for _, day, units in daily("x", 20)]
    frame = pl.DataFrame(rows, orient="row", schema=["region", "shop", "day", "units"])
    path = tmp_path / "sales.parquet"
    frame.sample(fraction=1.0, shuffle=True, seed=5).with_columns(
        pl.col("day").str.to_date()
    ).write_parquet(path)
    table = load_series(config(path, data={"id_columns": ["region", "shop"]}))
    observed = table.frame.filter(~pl.col(FUTURE))
    expected = (
        frame.with_columns(pl.col("day").str.to_date())
        .sort("region", "shop", "day")
        .with_columns(pl.struct("region", "shop").rle_id().cast(pl.Int64).alias(SERIES))
    )
    assert observed.select(expected.columns).equals(expected)
    assert table.frame[SERIES].is_sorted() and table.num_series == 9


def test_a_parquet_file_gives_the_table_its_csv_gives(tmp_path):
    """A Parquet file is read column by column and batch by batch (only the job's columns, its
    ids turned into categoricals as they are read): the table equals the one from the same rows
    as CSV. Integer ids order as text (`10` < `9`); columns the job does not name, of any type,
    are left out."""
    rows = []
    for region in ("west", "East"):
        for shop in (9, 10, 11):
            rows += [(region, shop, day, float(units)) for _, day, units in daily("x", 20)]
    frame = pl.DataFrame(rows, orient="row", schema=["region", "shop", "day", "units"])
    frame = frame.sample(fraction=1.0, shuffle=True, seed=3).with_columns(
        pl.col("day").str.to_date(),
        pl.col("units").alias("price"),
        pl.lit("a long description nobody forecasts").alias("note"),
        pl.concat_list("units", "units").alias("history"),
    )
    frame.write_parquet(tmp_path / "sales.parquet")
    frame.drop("history").write_csv(tmp_path / "sales.csv")
    both = [
        load_series(config(tmp_path / name, data={"id_columns": ["region", "shop"]}))
        for name in ("sales.parquet", "sales.csv")
    ]
    assert both[0].frame.equals(both[1].frame)
    assert both[0].frame.columns == [SERIES, "region", "shop", "day", "units", FUTURE]
    assert both[0].frame.schema["shop"] == pl.String
    first = both[0].frame.unique(SERIES, keep="first").sort(SERIES)
    assert first["shop"].to_list() == ["10", "11", "9"] * 2


def test_short_series_are_skipped_and_listed(tmp_path):
    source = write_csv(tmp_path, daily("a", 30) + daily("tiny", 8))
    table = load_series(config(source))
    assert table.num_series == 1
    assert table.skipped["shop"].to_list() == ["tiny"]
    assert "8 observations" in table.skipped["reason"][0]


def test_leading_and_trailing_empty_targets(tmp_path):
    rows = [("a", "2024-01-01", None), ("a", "2024-01-02", None), *daily("a", 25, start=3)]
    source = write_csv(tmp_path, rows)
    table = load_series(config(source))
    observed = table.frame.filter(~pl.col(FUTURE))
    assert observed.height == 25 and observed["units"].null_count() == 0


@pytest.mark.parametrize(
    ("rows", "change", "message"),
    [
        (daily("a", 20), {"target": "sold"}, "no column 'sold'; its columns are shop, day, units"),
        ([*daily("a", 20), ("a", "2024-01-05", 1.0)], {}, "appear more than once, e.g. shop=a"),
        (daily("a", 5) + daily("a", 20, start=7), {}, "not follow the previous one by 1d"),
    ],
)
def test_bad_tables_get_one_line(tmp_path, rows, change, message):
    source = write_csv(tmp_path, rows)
    with pytest.raises(ConfigError, match=message) as info:
        load_series(config(source, data=change))
    assert "\n" not in str(info.value)


def test_duplicates_are_counted_per_pair_and_the_first_is_named(tmp_path):
    extra = [("b", "2024-01-09", 1.0), ("b", "2024-01-09", 2.0), ("a", "2024-01-04", 1.0)]
    source = write_csv(tmp_path, daily("b", 20) + daily("a", 20) + extra)
    message = (
        "2 (series, day) pairs appear more than once, e.g. shop=a, day=2024-01-04 (2 rows); "
        "aggregate or deduplicate the table first"
    )
    with pytest.raises(ConfigError) as info:
        load_series(config(source))
    assert str(info.value) == message


def test_all_series_too_short_is_an_error(tmp_path):
    source = write_csv(tmp_path, daily("a", 8) + daily("b", 9))
    with pytest.raises(ConfigError, match=r"needs 15 observations .* the longest has 9"):
        load_series(config(source))


def test_missing_file_and_wrong_suffix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_series(config(tmp_path / "nope.csv"))
    with pytest.raises(ConfigError, match=r"expected a \.csv or \.parquet"):
        load_series(config(tmp_path / "data.xlsx"))


def test_text_target_is_rejected(tmp_path):
    path = tmp_path / "t.csv"
    pl.DataFrame(
        {
            "shop": ["a"] * 3,
            "day": ["2024-01-01", "2024-01-02", "2024-01-03"],
            "units": ["x", "y", "z"],
        }
    ).write_csv(path)
    with pytest.raises(ConfigError, match="column 'units' is String; it must be numeric"):
        load_series(config(path))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"features": {"lags": [1, 3]}}, "features.lags contains 1 but backtest.horizon is 3"),
        ({"models": {"names": ["prophet"]}}, "unknown model 'prophet'"),
        (
            {"models": {"args": {"lightgmb": {}}}},
            "models.args.lightgmb names no model; did you mean 'lightgbm'",
        ),
        (
            {"data": {"covariates": ["units"]}},
            "data.covariates names 'units', which is data.target; a column has one role",
        ),
        (
            {"data": {"covariates": ["shop"]}},
            "data.covariates names 'shop', which is one of data.id_columns; a column has one role",
        ),
        (
            {"data": {"covariates": ["promo", "promo"]}},
            "data.covariates names 'promo' twice; name each column once",
        ),
        (
            {"data": {"id_columns": ["shop", "day"]}},
            "data.id_columns names 'day', which is data.timestamp; a column has one role",
        ),
    ],
)
def test_config_checks(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        check(config(tmp_path / "x.csv", **sections))


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_fails_when_the_job_loads(tmp_path, seed):
    """numpy's generators take 0 to 2**32 - 1 (as training's job.seed); a negative seed once
    loaded and then failed inside the run, with a traceback."""
    with pytest.raises(ConfigError, match=r"job\.seed: input should be (greater|less) than"):
        config(tmp_path / "x.csv", job={"seed": seed})


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean 'backtest\.horizon'"):
        validate_as(ManyModelsConfig, {"backtest": {"horizn": 3}})


def test_us_employment_is_148_monthly_series():
    table = load_series(
        validate_as(ManyModelsConfig, {"backtest": {"horizon": 12, "n_windows": 1}})
    )
    assert table.freq == "1mo" and table.season_length == 12
    assert table.num_series + table.skipped.height == 148
    assert table.columns.ids == ("series_id",)


def test_reads_parquet_from_an_fsspec_url():
    import fsspec

    frame = pl.DataFrame(daily("a", 30), orient="row", schema=["shop", "day", "units"])
    frame = frame.with_columns(pl.col("day").str.to_date())
    with fsspec.open("memory://bucket/sales.parquet", "wb") as handle:
        frame.write_parquet(handle)
    table = load_series(config("memory://bucket/sales.parquet"))
    assert table.num_series == 1 and table.freq == "1d"


# Bad input: each is one line (a ConfigError), found in seconds, before any work or Ray starts.

GOOD = "shop,day,units\n" + "".join(f"a,2024-01-{d:02d},{d}.0\n" for d in range(1, 21))


def write_text(tmp_path, text: str, name: str = "sales.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"sales\.csv' is empty; it needs a header"),
        ("shop,day,units\n", r"sales\.csv' has column names but no rows"),
        (GOOD + "a,2024-01-21,21.0,9\n", "could not be read: found more fields than defined"),
        (
            GOOD + '"a,2024-01-21,21.0\na,2024-01-22,2\n',
            r"sales\.csv' could not be read: ",
        ),
        (GOOD + ",2024-01-21,1.0\n", r"1 row has no value in column 'shop', e\.g\. row 21 "),
        (GOOD + "a,,21.0\n", "1 row has no value in column 'day', e.g. row 21 of the table"),
        (GOOD + "a,2024-01-21,inf\n", r"1 row has an infinite value \(inf or -inf\) in column "),
        (GOOD + "a,2024-01-21,n/a\n", r"is String; it must be numeric \(1 is not a number, e.g. "),
        (GOOD.replace("2024-01-05", "2024-01-05zz"), "'day' holds text that is not a date or time"),
    ],
)
def test_bad_files_get_one_line(tmp_path, text, message):
    source = write_text(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_series(config(source))
    assert "\n" not in str(info.value) and len(str(info.value)) < len(source) + 400


def test_a_parquet_file_that_is_text(tmp_path):
    source = write_text(tmp_path, GOOD, "sales.parquet")
    with pytest.raises(ConfigError, match="could not be read: parquet") as info:
        load_series(config(source))
    assert "\n" not in str(info.value)


def test_a_column_with_no_values_is_an_empty_target_not_text(tmp_path):
    source = write_text(
        tmp_path, "shop,day,units\n" + "".join(f"a,2024-01-0{d},\n" for d in (1, 2))
    )
    with pytest.raises(ConfigError, match="the table has no rows with a value in 'units'"):
        load_series(config(source))


def test_group_by_names_a_column_the_features_see(tmp_path):
    source = write_text(tmp_path, GOOD)
    with pytest.raises(ConfigError, match=r"features.group_by names 'store', which is not one of"):
        load_series(config(source, features={"group_by": [["store"]]}))


@pytest.mark.parametrize("freq", ["banana", "0d", "-1w", "1d12h", "mo"])
def test_freq_is_one_positive_duration(freq):
    with pytest.raises(ConfigError, match=r"data\.freq: expected a positive count and a unit"):
        validate_as(ManyModelsConfig, {"data": {"freq": freq}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": {"season_length": 10**8}}, "season_length = 100000000 is longer than the longe"),
        ({"data": {"season_length": 10**20}}, "is longer than the longest series .20 observations"),
        ({"backtest": {"horizon": 10**6}}, "horizon = 1000000 is not shorter than the longest"),
    ],
)
def test_sizes_the_data_cannot_support_fail_at_once(tmp_path, change, message):
    """Without the bound these allocate a lag per season step, or a future row per horizon step:
    killed for memory, or hours."""
    source = write_text(tmp_path, GOOD)
    with pytest.raises(ConfigError, match=message):
        load_series(config(source, features={"lags": []}, **change))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"periods": 12}, r"horizon = 12 is not shorter than the synthetic series \(data.periods"),
        ({"num_series": 10**9}, r"= 168,000,000,000 rows is more than the generator makes"),
        ({"periods": 10**9}, r"= 1,000,000,012,000 rows is more than the generator makes"),
    ],
)
def test_synthetic_data_is_bounded(data, message):
    raw = {"data": {"source": "retail_synthetic", **data}, "backtest": {"horizon": 12}}
    with pytest.raises(ConfigError, match=message):
        check(validate_as(ManyModelsConfig, raw))


def test_resume_ignores_entries_that_are_not_finished_chunks(tmp_path):
    from shardwise.manymodel.run.chunk_store import finished_chunks
    from shardwise.manymodel.run.outputs import TABLES

    chunks = tmp_path / "chunks"
    for name in ("chunk-000002", "chunk-abc", "chunk-", "chunk-000001.partial-7", "chunk-1"):
        (chunks / name).mkdir(parents=True)
        (chunks / name / "done").write_text("{}")
        for table in TABLES:
            (chunks / name / f"{table}.parquet").write_bytes(b"")
    (chunks / "notes.txt").write_text("mine")
    (chunks / "chunk-000003").touch()
    (chunks / "chunk-000004").mkdir()  # finished, then a file of it removed: run it again
    (chunks / "chunk-000004" / "done").write_text("{}")
    assert finished_chunks(tmp_path, config(tmp_path / "x.csv"), resume=True) == {2}


def test_resume_of_a_run_whose_job_no_longer_loads_is_one_line(tmp_path):
    """A run made before backtest.intervals = "conformal" was renamed: its saved job.toml is
    refused, and the message says what to do with the run directory."""
    from shardwise.manymodel.run.chunk_store import finished_chunks
    from shardwise.manymodel.run.outputs import TABLES

    chunk = tmp_path / "chunks" / "chunk-000000"
    chunk.mkdir(parents=True)
    (chunk / "done").write_text("{}")
    for table in TABLES:
        (chunk / f"{table}.parquet").write_bytes(b"")
    (tmp_path / "job.toml").write_text('[backtest]\nintervals = "conformal"\n')
    with pytest.raises(ConfigError, match=r"^--resume: .*job\.toml, the job its chunks were made"):
        finished_chunks(tmp_path, config(tmp_path / "x.csv"), resume=True)


@pytest.mark.parametrize(
    ("layout", "done", "message"),
    [
        (None, {0}, "holds finished chunks but no readable layout.json"),
        ('{"series": 5, "chunk_size": 2}', {0}, "cut from 5 series, the data now has 4; the data"),
        ('{"series": 4, "chunk_size": 2}', {0, 9}, r"chunk-000009 is beyond the 2 chunks"),
    ],
)
def test_resume_refuses_chunks_of_other_data(tmp_path, layout, done, message):
    from shardwise.manymodel.run.chunk_store import saved_chunk_size

    (tmp_path / "chunks").mkdir()
    if layout:
        (tmp_path / "chunks" / "layout.json").write_text(layout)
    with pytest.raises(ConfigError, match=message):
        saved_chunk_size(tmp_path, 4, done)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def loopback_ray_imported(monkeypatch):
    """Import ray as start_ray does (loopback only), so later tests that start Ray see it so;
    wait 1 s for an address to answer instead of 10."""
    from shardwise.common import ray_cluster

    with ray_cluster.loopback_ray():
        import ray  # noqa: F401
    monkeypatch.setattr(ray_cluster, "RAY_CONNECT_TIMEOUT_S", 1.0)


@pytest.mark.usefixtures("loopback_ray_imported")
@pytest.mark.parametrize(
    ("address", "message"),
    [
        (
            "127.0.0.1:{port}",
            r"nothing answers at .*:{port} \(.onnection refused; waited up to 1 s\)",
        ),
        ("ray://localhost:{port}", r"nothing answers at localhost:{port} \(.onnection refused"),
        ("banana", "is not an address; give the head node's host:port"),
        ("host:99999", "is not an address"),
    ],
)
def test_an_unreachable_ray_address_fails_in_seconds(address, message):
    from shardwise.common.ray_cluster import check_ray_address

    port = closed_port()
    with pytest.raises(ConfigError, match=message.format(port=port)):
        check_ray_address(address.format(port=port), "--ray-address")


@pytest.mark.usefixtures("loopback_ray_imported")
def test_cli_unreachable_ray_address_is_one_line(tmp_path):
    """As a user runs it: in a process of its own, where no Ray is connected yet."""
    job = tmp_path / "job.toml"
    source = write_text(tmp_path, GOOD)
    columns = 'id_columns = ["shop"]\ntimestamp = "day"\ntarget = "units"\n'
    job.write_text(f'[data]\nsource = "{source}"\n{columns}')
    done = helpers.shardwise_command(
        "many-models", str(job), "--set", f"job.run_dir={tmp_path / 'run'}",
        "--ray-address", f"127.0.0.1:{closed_port()}", timeout=120,
    )  # fmt: skip
    err = done.stderr
    assert done.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith("shardwise: error: runner.ray") and "waited up to 10 s" in err


@pytest.mark.usefixtures("loopback_ray_imported")
def test_a_head_still_starting_is_waited_for():
    from shardwise.common.ray_cluster import check_ray_address

    port = closed_port()
    with socket.socket() as head:
        head.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        head.bind(("127.0.0.1", port))
        timer = threading.Timer(0.4, head.listen)
        timer.start()
        check_ray_address(f"127.0.0.1:{port}", "--ray-address")  # refused, then answered
        timer.join()


def test_cli_empty_file_is_one_line(tmp_path, capsys):
    from shardwise.cli import main

    job = tmp_path / "job.toml"
    source = write_text(tmp_path, "")
    job.write_text(
        f'[data]\nsource = "{source}"\nid_columns = ["shop"]\ntimestamp = "day"\ntarget = "units"\n'
    )
    code = main(["many-models", str(job), "--set", f"job.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and err
        == f"shardwise: error: data.source = '{source}' is empty; it needs "
        "a header and one row per series and timestamp\n"
    )


def test_the_eta_counts_time_in_tasks_after_each_workers_warm_up():
    """The chunks of a us_employment run with the statistical models, as two workers measured
    them inside their tasks: each worker's first chunk took ~24 s, ~10 s of it importing and
    compiling, the later ones 12-17 s. Once a worker has run a second chunk the ETA comes from
    the later chunks alone, per input row; Ray's start (outside the tasks) never counts."""
    from shardwise.manymodel.run.eta import Eta

    eta = Eta(rows=8 * 1000, slots=2)
    assert math.isnan(eta.seconds())
    eta.done(1000, 24.0, worker=1)
    assert eta.seconds() == pytest.approx(7000 * 0.024 / 2)  # nothing better to go on yet
    eta.done(1000, 24.0, worker=2)
    eta.done(1000, 15.0, worker=1)  # worker 1 is warm
    assert eta.seconds() == pytest.approx(5000 * 0.015 / 2)
    eta.done(500, 6.0, worker=2)  # a shorter chunk: the rate is per row
    assert eta.seconds() == pytest.approx(4500 * (21.0 / 1500) / 2)
    eta.done(1000)  # lost with its worker: less left, no time learnt
    assert eta.seconds() == pytest.approx(3500 * (21.0 / 1500) / 2)


def monthly_rows(shop: str, dates: list[date]) -> list[tuple[str, str, float]]:
    return [(shop, d.isoformat(), float(i % 7 + 1)) for i, d in enumerate(dates)]


def ends(first: date, months: int, periods: int) -> list[date]:
    """The last day of every `months`-th month from `first`'s (pandas' ME, QE, YE)."""
    out = []
    for k in range(periods):
        index = first.year * 12 + first.month - 1 + k * months
        year, month = divmod(index, 12)
        following = date(year + (month + 1) // 12, (month + 1) % 12 + 1, 1)
        out.append(date.fromordinal(following.toordinal() - 1))
    return out


@pytest.mark.parametrize(
    ("months", "freq", "set_freq"),
    [(1, "1mo", ""), (1, "1mo", "1mo"), (3, "3mo", ""), (3, "1q", "1q"), (12, "1y", "")],
)
def test_month_quarter_and_year_ends_are_regular_and_the_future_ends_months_too(
    tmp_path, months, freq, set_freq
):
    """pandas' month-end dates (2000-02-29, 2000-03-31, …): each step moves the month and
    keeps the series' day, clipped to the month's length; the future rows end months too."""
    dates = ends(date(1999, 11, 30), months, 60)
    source = write_csv(tmp_path, monthly_rows("a", dates) + monthly_rows("b", dates[5:]))
    job = config(
        source,
        data={"freq": set_freq},
        backtest={"horizon": 4, "n_windows": 2, "min_train": 8},
        features={"lags": [4, 5]},
    )
    table = load_series(job)
    assert table.freq == freq
    future = table.frame.filter(pl.col(FUTURE) & (pl.col("shop") == "a"))["day"].to_list()
    assert future == ends(dates[-1], months, 5)[1:]


def test_a_fixed_day_of_the_month_is_kept_and_clipped_to_short_months(tmp_path):
    """The 30th of every month is the 28th or 29th in February; the 15th stays the 15th."""
    thirtieth = [date(2001 + (m // 12), m % 12 + 1, 28 if m % 12 == 1 else 30) for m in range(36)]
    fifteenth = [date(2001 + (m // 12), m % 12 + 1, 15) for m in range(36)]
    source = write_csv(tmp_path, monthly_rows("a", thirtieth) + monthly_rows("b", fifteenth))
    table = load_series(config(source, backtest={"horizon": 3, "n_windows": 2, "min_train": 8}))
    assert table.freq == "1mo"
    future = table.frame.filter(pl.col(FUTURE)).sort("shop", "day")["day"].to_list()
    thirtieths = [date(2004, 1, 30), date(2004, 2, 29), date(2004, 3, 30)]
    assert future == [*thirtieths, date(2004, 1, 15), date(2004, 2, 15), date(2004, 3, 15)]


@pytest.mark.parametrize(
    ("set_freq", "message"),
    [
        (
            "",
            r"by 1mo \(inferred from the data\), e\.g\. series shop=a at 2000-06-30 "
            r"\(after 2000-04-30\); add the missing rows \(empty target\) or set data\.freq",
        ),
        (
            "1mo",
            r"by 1mo \(data\.freq\), e\.g\. series shop=a at 2000-06-30 \(after 2000-04-30\); add "
            r"the missing rows \(empty target\)$",
        ),
        (
            "1d",
            r"by 1d \(data\.freq\), e\.g\. series shop=a at .*; the data steps by 1mo: set "
            r"data\.freq = \"1mo\" or leave it empty to infer it$",
        ),
    ],
)
def test_the_frequency_error_says_what_to_change(tmp_path, set_freq, message):
    dates = ends(date(2000, 1, 31), 1, 40)
    source = write_csv(tmp_path, monthly_rows("a", dates[:4] + dates[5:]))
    with pytest.raises(ConfigError, match=message) as info:
        load_series(config(source, data={"freq": set_freq}))
    assert "\n" not in str(info.value)


def test_ids_in_a_csv_are_text_as_written(tmp_path):
    """ "007" and "07" are two series, "+01.3" stays "+01.3": ids are names, not numbers."""
    rows = [
        (shop, day, units)
        for name in ("007", "07", "+01.3")
        for shop, day, units in daily(name, 20)
    ]
    path = tmp_path / "sales.csv"
    path.write_text("shop,day,units\n" + "".join(f"{s},{d},{u}\n" for s, d, u in rows))
    table = load_series(config(path))
    assert table.series_ids()["shop"].to_list() == ["+01.3", "007", "07"]


def test_a_job_of_models_that_read_the_target_only_needs_no_feature_warm_up(tmp_path):
    """60 monthly observations, 3 windows of 12: enough for statistical models (statsforecast
    cross-validates the same windows); a model that reads lags needs the lags' rows too."""
    dates = ends(date(2000, 1, 31), 1, 60)
    source = write_csv(tmp_path, monthly_rows("a", dates) + monthly_rows("b", dates))
    backtest = {"horizon": 12, "n_windows": 3, "min_train": 0}
    statistical = config(
        source,
        backtest=backtest,
        features={"lags": []},
        models={"names": ["seasonal_naive", "auto_ets", "auto_theta"]},
    )
    assert load_series(statistical).num_series == 2
    with pytest.raises(ConfigError, match=r"the backtest needs 83 observations .* lower the "):
        load_series(
            config(
                source,
                backtest=backtest,
                features={"lags": []},
                models={"names": ["auto_ets", "ridge"]},
            )
        )
