"""A service's Prometheus /metrics, read as a test wants it: each sample by its name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]


def scrape(port: int) -> tuple[Samples, set[str]]:
    """Every sample as name{label="value",...} (labels sorted) -> value, and the family names."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples, families


def total(samples: Samples, name: str) -> float:
    """A metric summed over its labels (name may also name one labelled sample exactly)."""
    return sum(value for key, value in samples.items() if key == name or key.startswith(name + "{"))
