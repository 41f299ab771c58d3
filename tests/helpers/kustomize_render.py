"""Renders a kustomization with a real kustomize and reads the rendered pods' command lines as the
kubelet would run them ($(VAR) expanded from the container's environment)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

# $$ escapes a dollar; $(NAME) is replaced when NAME is in the environment, else left as is
# (Kubernetes' expansion rules for command, args and env values).
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_CPU_SUFFIX = {"m": Decimal("0.001"), "": Decimal(1)}


def kustomize_command() -> list[str] | None:
    """kubectl's built-in kustomize, else a standalone kustomize; None when neither is here."""
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    return None


def render(command: list[str], directory: Path) -> list[Object]:
    result = subprocess.run(
        [*command, str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def cpu_cores(quantity: str | int) -> Decimal:
    text = str(quantity)
    suffix = "m" if text.endswith("m") else ""
    return Decimal(text.removesuffix(suffix)) * _CPU_SUFFIX[suffix]


def _resource_value(pod: Object, container: Object, ref: Object) -> str:
    owner_name = ref.get("containerName", container["name"])
    owner = next(c for c in pod["containers"] if c["name"] == owner_name)
    section, _, resource = ref["resource"].partition(".")
    if resource != "cpu":
        raise NotImplementedError(f"resourceFieldRef {ref['resource']} is not modelled here")
    amount = cpu_cores(owner["resources"][section]["cpu"]) / cpu_cores(ref.get("divisor", "1"))
    # The kubelet rounds up: 500m with divisor 1 is one core.
    return str(math.ceil(amount))


def container_env(obj: Object, container: Object) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (the kinds of source used here)."""
    pod = obj["spec"]["template"]["spec"]
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            env[entry["name"]] = expand(entry.get("value", ""), env)
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[entry["name"]] = obj["metadata"]["namespace"]
        elif "resourceFieldRef" in source:
            env[entry["name"]] = _resource_value(pod, container, source["resourceFieldRef"])
        else:
            raise NotImplementedError(f"env source {source} is not modelled here")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, text)


def container_argv(obj: Object, container: Object) -> list[str]:
    """command + args after the kubelet's $(VAR) expansion."""
    env = container_env(obj, container)
    return [expand(part, env) for part in [*container.get("command", []), *container.get("args", [])]]
