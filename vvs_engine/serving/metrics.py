"""The server's Prometheus metrics, written in the text exposition format by hand (no dependency):
counters, gauges and histograms with labels, vLLM-style ``vvs:`` names, labelled with model and method.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ROUND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _labels(pairs: Sequence[Tuple[str, str]]) -> str:
    if not pairs:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped)) + "}"


def _number(x: float) -> str:
    if x == float("inf"):
        return "+Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, base: Sequence[Tuple[str, str]]):
        self.name, self.help, self.base = name, help_text, tuple(base)
        self.lock = threading.Lock()

    def header(self) -> list:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, base, label_names: Sequence[str] = (), initial: Sequence[str] = ()):
        super().__init__(name, help_text, base)
        self.label_names = tuple(label_names)
        self.values: Dict[tuple, float] = {}
        for value in initial:  # label values shown at 0 before they first happen
            self.values[(value,)] = 0.0
        if not self.label_names:
            self.values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(labels[n] for n in self.label_names)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        return self.values.get(tuple(labels[n] for n in self.label_names), 0.0)

    def render(self) -> list:
        with self.lock:
            items = sorted(self.values.items())
        return self.header() + [f"{self.name}{_labels(self.base + tuple(zip(self.label_names, key)))} {_number(v)}"
                                for key, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, help_text, base, read: Callable[[], float]):
        super().__init__(name, help_text, base)
        self.read = read

    def render(self) -> list:
        return self.header() + [f"{self.name}{_labels(self.base)} {_number(self.read())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, base, buckets: Sequence[float], label_names: Sequence[str] = ()):
        super().__init__(name, help_text, base)
        self.buckets = tuple(buckets) + (float("inf"),)
        self.label_names = tuple(label_names)
        self.series: Dict[tuple, list] = {}  # labels -> [bucket counts..., sum, count]
        if not self.label_names:
            self.series[()] = [0] * len(self.buckets) + [0.0, 0]

    def observe(self, value: float, **labels) -> None:
        key = tuple(labels[n] for n in self.label_names)
        with self.lock:
            row = self.series.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    row[i] += 1
            row[-2] += value
            row[-1] += 1

    def count(self, **labels) -> int:
        return self.series.get(tuple(labels[n] for n in self.label_names), [0])[-1]

    def render(self) -> list:
        lines = self.header()
        with self.lock:
            items = sorted((k, list(v)) for k, v in self.series.items())
        for key, row in items:
            pairs = self.base + tuple(zip(self.label_names, key))
            for bound, n in zip(self.buckets, row):
                lines.append(f"{self.name}_bucket{_labels(pairs + (('le', _number(bound)),))} {n}")
            lines.append(f"{self.name}_sum{_labels(pairs)} {_number(row[-2])}")
            lines.append(f"{self.name}_count{_labels(pairs)} {row[-1]}")
        return lines


REJECTION_REASONS = ("queue_full", "not_ready", "draining", "bad_request", "too_large", "unauthorized", "timeout")
FINISH_REASONS = ("completed", "disconnected", "deadline", "aborted", "error")


class ServerMetrics:
    """Every metric of one server. The gauges read the request queue when scraped (``bind_queue``)."""

    def __init__(self, model: str, method: str):
        base = (("model", model), ("method", method))
        self.base = base
        self.queue_time = Histogram("vvs:request_queue_time_seconds",
                                    "Seconds from a request's arrival to its first image's admission.", base,
                                    LATENCY_BUCKETS)
        self.time_to_first_token = Histogram("vvs:time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first committed token.",
                                             base, LATENCY_BUCKETS)
        self.e2e_latency = Histogram("vvs:e2e_request_latency_seconds",
                                     "Seconds from a request's arrival to its last image (successful requests).",
                                     base, LATENCY_BUCKETS)
        self.round_seconds = Histogram("vvs:round_seconds", "Host seconds per decode round, by round kind.", base,
                                       ROUND_BUCKETS, ("kind",))
        self.images = Counter("vvs:images_generated_total", "Images decoded to the end.", base)
        self.tokens_committed = Counter("vvs:tokens_committed_total", "Image tokens committed (finished images).",
                                        base)
        self.target_forwards = Counter("vvs:target_forward_passes_total",
                                       "Target forward passes of finished images.", base)
        self.accepted = Counter("vvs:spec_accepted_tokens_total",
                                "Tokens committed beyond one per target forward (accepted draft tokens).", base)
        self.skipped_rounds = Counter("vvs:skipped_rounds_total",
                                      "Rounds with no target forward (VVS verification skips).", base)
        self.success = Counter("vvs:request_finished_total", "Requests finished, by reason.", base,
                               ("finished_reason",), FINISH_REASONS)
        self.rejected = Counter("vvs:requests_rejected_total", "Requests refused before any work, by reason.",
                                base, ("reason",), REJECTION_REASONS)
        self.gauges: list = []

    def metrics(self) -> list:
        return self.gauges + [self.queue_time, self.time_to_first_token, self.e2e_latency, self.round_seconds,
                              self.images, self.tokens_committed, self.target_forwards, self.accepted,
                              self.skipped_rounds, self.success, self.rejected]

    def add_label(self, name: str, value: str) -> None:
        """A label on every series from now on (a Ray Serve replica's id, so that the replicas' series
        stay apart in one view)."""
        self.base = self.base + ((name, value),)
        for metric in self.metrics():
            metric.base = metric.base + ((name, value),)

    def bind_queue(self, snapshot: Callable[[], dict], rows: int) -> None:
        def read(key):
            return lambda: snapshot()[key]

        self.gauges = [
            Gauge("vvs:num_requests_running", "Requests with at least one image in the batch.", self.base,
                  read("requests_running")),
            Gauge("vvs:num_requests_waiting", "Accepted requests with no image in the batch yet.", self.base,
                  read("requests_waiting")),
            Gauge("vvs:num_images_running", "Images decoding in the batch's rows.", self.base, read("images_running")),
            Gauge("vvs:num_images_waiting", "Images queued for a free row.", self.base, read("images_waiting")),
            Gauge("vvs:batch_rows", "Rows in flight (fixed per server).", self.base, lambda: rows),
        ]

    def image_done(self, tokens: int, passes: float, rounds: float) -> None:
        self.images.inc()
        self.tokens_committed.inc(tokens)
        self.target_forwards.inc(passes)
        self.accepted.inc(max(0.0, tokens - passes))
        self.skipped_rounds.inc(max(0.0, rounds - passes))

    def render(self) -> str:
        lines = []
        for metric in self.metrics():
            lines += metric.render()
        return "\n".join(lines) + "\n"


def merge_texts(texts: Sequence[str]) -> str:
    """One exposition from several (Ray Serve replicas' ``render()``, each labelled with its replica):
    each metric family once, its HELP and TYPE once, the samples of every text under it."""
    families: Dict[str, list] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                lines = families.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
            elif line and family is not None:
                families[family].append(line)
    return "\n".join(line for lines in families.values() for line in lines) + "\n"


def parse_text(text: str) -> Dict[str, float]:
    """{'name{labels}': value} of a text exposition (tests and the load benchmark read /metrics)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def sample(values: Dict[str, float], name: str, **labels) -> Optional[float]:
    """The value of metric ``name`` whose labels include ``labels`` (None when absent)."""
    for key, value in values.items():
        metric, _, rest = key.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return value
    return None
