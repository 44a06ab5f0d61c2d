#!/usr/bin/env python3
"""Validates the Kubernetes manifests under deploy/kubernetes, without a cluster or kubectl.

    python3 -m venv .venv && .venv/bin/pip install -r deploy/kubernetes/requirements.txt
    .venv/bin/python scripts/validate-kubernetes.py [--kubernetes-version 1.37] [DIRECTORY]

What it checks:

- every kustomization.yaml: only known fields; its `resources` exist; its
  configMapGenerator files exist inside its directory. The ConfigMaps the generators
  would make are built (without the hash suffix) and validated like the other resources.
  This is not kustomize: patches, images and labels are not applied, so each resource
  file must be valid as written;
- every Kubernetes resource in a YAML file (the examples not listed in a kustomization
  included) against the schemas of one Kubernetes version that kubernetes-validate
  ships (the latest by default), in strict mode: an unknown or misspelt field fails;
- KEDA ScaledObjects, whose schema is a CRD Kubernetes does not ship: the fields KEDA
  needs, Prometheus triggers, and that their queries name metrics the gateway exports
  (crates/outbox-core/src/metrics.rs);
- the files the generators embed: gateway.toml parses as TOML; subscriptions.yaml parses
  as YAML, with a top-level `subscriptions` list, and is valid against the file format's
  JSON Schema, docs/subscriptions.schema.json (without it, its field names are checked
  against the Subscription message of the proto); so is examples/subscriptions.yaml, and
  the schema must refuse entries `outbox-gateway apply` refuses as it reads a file;
- that the pieces fit together: selectors match the pod labels, ports, probes and
  ConfigMap volumes name what exists, the ports of gateway.toml are the container's, push
  endpoints are allowed by gateway.toml's [push] allowed_hosts, and every Secret key a
  workload reads is documented by a Secret of the examples.

Prints one line per file and exits 1, naming the file and the error, on any failure.
"""

import argparse
import datetime
import json
import re
import sys
import urllib.parse
from pathlib import Path

try:
    import jsonschema
    import kubernetes_validate
    import yaml
    from kubernetes_validate import utils as kv_utils
except ImportError as error:
    sys.exit(
        f"validate-kubernetes: {error}; install the requirements first: "
        "pip install -r deploy/kubernetes/requirements.txt"
    )

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

REPO = Path(__file__).resolve().parent.parent
PROTO = REPO / "crates/outbox-client/proto/outbox/v1/outbox.proto"
SUBSCRIPTIONS_SCHEMA = REPO / "docs/subscriptions.schema.json"
METRICS = REPO / "crates/outbox-core/src/metrics.rs"

# The fields of a kustomization (kustomize v5).
KUSTOMIZATION_FIELDS = {
    "apiVersion", "kind", "metadata", "resources", "components", "crds", "namespace",
    "namePrefix", "nameSuffix", "commonLabels", "labels", "commonAnnotations", "patches",
    "patchesStrategicMerge", "patchesJson6902", "images", "replicas", "configMapGenerator",
    "secretGenerator", "generatorOptions", "generators", "transformers", "validators",
    "replacements", "vars", "configurations", "openapi", "buildMetadata", "sortOptions",
    "helmCharts", "helmGlobals", "inventory", "bases",
}
LABELS_FIELDS = {"pairs", "includeSelectors", "includeTemplates", "fields"}
GENERATOR_FIELDS = {"name", "namespace", "behavior", "files", "literals", "envs", "env", "options"}

# Subscription fields the gateway reports but nobody sets.
OUTPUT_ONLY = {"created_at", "paused_at", "push_stopped", "signing_secret"}
DURATION_FIELDS = {
    "ack_deadline", "retry_backoff_min", "retry_backoff_max", "max_event_age",
    "expire_after_idle", "timeout", "max_batch_wait",
}
DURATION = re.compile(r"^(\d+(\.\d+)?\s*(ns|us|ms|s|sec|secs|m|min|mins|h|hr|hrs|d|days|w)\s*)+$")
SUBSCRIPTION_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


class Failures:
    def __init__(self):
        self.count = 0

    def __call__(self, where, message):
        self.count += 1
        print(f"FAIL {where}: {message}")


fail = Failures()


def relative(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def load_documents(path):
    """The YAML documents of a file (empty ones left out), or None when it does not parse."""
    try:
        return [doc for doc in yaml.safe_load_all(Path(path).read_text()) if doc is not None]
    except yaml.YAMLError as error:
        fail(relative(path), f"does not parse as YAML: {error}")
        return None


class Rendered:
    """What one kustomization puts together: its resources and generated ConfigMaps."""

    def __init__(self, directory):
        self.directory = directory
        self.resources = []  # (file, document)
        self.generated = {}  # ConfigMap name -> {key: (file, text)}


def render(directory, seen_files, stack=()):
    """Reads the kustomization in `directory`, checking its fields and references."""
    directory = directory.resolve()
    path = directory / "kustomization.yaml"
    where = relative(path)
    rendered = Rendered(directory)
    if directory in stack:
        fail(where, "includes itself through its resources")
        return rendered
    docs = load_documents(path)
    if not docs:
        return rendered
    if len(docs) != 1 or not isinstance(docs[0], dict):
        fail(where, "must be one YAML mapping")
        return rendered
    kustomization = docs[0]
    seen_files.add(path.resolve())
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        fail(where, f"kind is {kustomization.get('kind')!r}, not Kustomization")
    for field in sorted(set(kustomization) - KUSTOMIZATION_FIELDS):
        fail(where, f"unknown field {field!r}")
    for index, entry in enumerate(kustomization.get("labels") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("pairs"), dict):
            fail(where, f"labels[{index}] needs a `pairs` mapping")
            continue
        for field in sorted(set(entry) - LABELS_FIELDS):
            fail(where, f"labels[{index}]: unknown field {field!r}")

    for entry in kustomization.get("resources") or []:
        if re.match(r"^(https?|git|ssh)://|^github\.com/", str(entry)):
            print(f"  note {where}: remote resource {entry} not checked")
            continue
        target = (directory / entry).resolve()
        if target.is_dir():
            if not (target / "kustomization.yaml").is_file():
                fail(where, f"resource {entry} is a directory without kustomization.yaml")
                continue
            inner = render(target, seen_files, stack + (directory,))
            rendered.resources += inner.resources
            rendered.generated.update(inner.generated)
        elif target.is_file():
            seen_files.add(target)
            for doc in load_documents(target) or []:
                rendered.resources.append((target, doc))
        else:
            fail(where, f"resource {entry} does not exist")

    for index, generator in enumerate(kustomization.get("configMapGenerator") or []):
        label = f"configMapGenerator[{index}]"
        if not isinstance(generator, dict) or not generator.get("name"):
            fail(where, f"{label} needs a name")
            continue
        for field in sorted(set(generator) - GENERATOR_FIELDS):
            fail(where, f"{label}: unknown field {field!r}")
        data = {}
        for entry in generator.get("files") or []:
            key, _, file = str(entry).rpartition("=")
            file_path = (directory / file).resolve()
            key = key or Path(file).name
            if directory not in file_path.parents:
                fail(where, f"{label}: {file} is outside the kustomization's directory")
            elif not file_path.is_file():
                fail(where, f"{label}: file {file} does not exist")
            else:
                data[key] = (file_path, file_path.read_text())
        for literal in generator.get("literals") or []:
            key, _, value = str(literal).partition("=")
            data[key] = (path, value)
        for env in generator.get("envs") or []:
            fail(where, f"{label}: envs ({env}) are not checked by this script")
        rendered.generated[generator["name"]] = data
    return rendered


def validate_resource(file, doc, version):
    where = relative(file)
    if not isinstance(doc, dict) or not doc.get("apiVersion") or not doc.get("kind"):
        fail(where, "a document without apiVersion and kind")
        return
    name = f"{doc['kind']}/{(doc.get('metadata') or {}).get('name', '?')}"
    if str(doc["apiVersion"]).startswith("keda.sh/"):
        check_scaled_object(where, name, doc)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(part) for part in error.path) or "(top)"
        fail(where, f"{name}: {path}: {error.message}")
    except kubernetes_validate.SchemaNotFoundError as error:
        fail(where, f"{name}: {error.message}")
    else:
        print(f"  ok   {where}: {name}")


def check_scaled_object(where, name, doc):
    """KEDA's ScaledObject: what KEDA needs to act on it, checked by hand."""
    errors = []
    if doc.get("apiVersion") != "keda.sh/v1alpha1" or doc.get("kind") != "ScaledObject":
        errors.append(f"expected keda.sh/v1alpha1 ScaledObject, got {doc.get('apiVersion')} {doc.get('kind')}")
    if not (doc.get("metadata") or {}).get("name"):
        errors.append("metadata.name is missing")
    spec = doc.get("spec") or {}
    unknown = set(spec) - {
        "scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
        "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced",
        "triggers",
    }
    errors += [f"spec.{field}: unknown field" for field in sorted(unknown)]
    if not (spec.get("scaleTargetRef") or {}).get("name"):
        errors.append("spec.scaleTargetRef.name is missing")
    for field in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        if field in spec and not isinstance(spec[field], int):
            errors.append(f"spec.{field} must be an integer")
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        errors.append("spec.minReplicaCount is above spec.maxReplicaCount")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        errors.append("spec.triggers must be a non-empty list")
        triggers = []
    exported = exported_metrics()
    for index, trigger in enumerate(triggers):
        at = f"spec.triggers[{index}]"
        if not isinstance(trigger, dict) or trigger.get("type") != "prometheus":
            errors.append(f"{at}.type must be prometheus")
            continue
        metadata = trigger.get("metadata") or {}
        for field in ("serverAddress", "query", "threshold"):
            if not isinstance(metadata.get(field), str) or not metadata[field].strip():
                errors.append(f"{at}.metadata.{field} must be a non-empty string")
        if not re.match(r"^https?://", str(metadata.get("serverAddress", ""))):
            errors.append(f"{at}.metadata.serverAddress must be an http(s) URL")
        for field in ("threshold", "activationThreshold"):
            if field in metadata:
                try:
                    float(metadata[field])
                except (TypeError, ValueError):
                    errors.append(f"{at}.metadata.{field} must be a number in a string")
        if exported is not None:
            for metric in re.findall(r"\boutbox_[a-z0-9_]+", str(metadata.get("query", ""))):
                if metric not in exported:
                    errors.append(f"{at}.metadata.query: the gateway exports no metric {metric}")
    for error in errors:
        fail(where, f"{name}: {error}")
    if not errors:
        print(f"  ok   {where}: {name} (KEDA, checked by this script)")


def exported_metrics():
    """The names of the gateway's metrics, or None when the source is not at hand."""
    if not METRICS.is_file():
        return None
    return set(re.findall(r'"(outbox_[a-z0-9_]+)"', METRICS.read_text()))


def proto_fields(message):
    """The field names of a message of the gateway's proto, or None without the proto."""
    if not PROTO.is_file():
        return None
    text = PROTO.read_text()
    start = re.search(r"^message %s \{" % message, text, re.M)
    if not start:
        return None
    depth, body = 0, []
    for line in text[start.end() - 1:].splitlines():
        depth += line.count("{") - line.count("}")
        body.append(line)
        if depth == 0:
            break
    field = re.compile(r"^\s*(?:repeated |optional )?[\w.]+(?:<[\w.]+,\s*[\w.]+>)? (\w+) = \d+;")
    return {m.group(1) for m in map(field.match, body) if m}


def check_subscriptions(file, text):
    """subscriptions.yaml; returns its push endpoints, as (path in the file, URL)."""
    where = relative(file)
    before = fail.count
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as error:
        fail(where, f"does not parse as YAML: {error}")
        return []
    if not isinstance(doc, dict) or not isinstance(doc.get("subscriptions"), list):
        fail(where, "needs a top-level `subscriptions` list")
        return []
    if SUBSCRIPTIONS_SCHEMA.is_file():
        against = relative(SUBSCRIPTIONS_SCHEMA)
        schema = json.loads(SUBSCRIPTIONS_SCHEMA.read_text())
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        for error in sorted(validator.iter_errors(doc), key=lambda error: list(error.absolute_path)):
            path = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path
            ).lstrip(".")
            fail(where, f"{path or '(top)'}: {error.message} ({against})")
    else:
        against = "the proto's field names"
        check_subscriptions_without_schema(where, doc)

    # What the schema cannot say, and the endpoints for the check against allowed_hosts.
    names, endpoints = {}, []
    for index, subscription in enumerate(doc["subscriptions"]):
        if not isinstance(subscription, dict):
            continue
        at = f"subscriptions[{index}]"
        name = subscription.get("name")
        if name in names:
            fail(where, f"{at}.name: {name} is named already by subscriptions[{names[name]}]")
        names.setdefault(name, index)
        if "push" in subscription and "sink" in subscription:
            fail(where, f"{at}: push and sink cannot both be set")
        endpoint = (subscription.get("push") or {}).get("endpoint")
        if isinstance(endpoint, str):
            if re.match(r"^https?://", endpoint):
                endpoints.append((f"{at}.push.endpoint", endpoint))
            else:
                fail(where, f"{at}.push.endpoint must be an http:// or https:// URL")
    if fail.count == before:
        print(f"  ok   {where}: {len(names)} subscriptions, checked against {against}")
    return endpoints


def check_schema_refusals():
    """Entries `outbox-gateway apply` refuses as it reads the file must not validate."""
    if not SUBSCRIPTIONS_SCHEMA.is_file():
        return
    where = relative(SUBSCRIPTIONS_SCHEMA)
    validator = jsonschema.Draft202012Validator(json.loads(SUBSCRIPTIONS_SCHEMA.read_text()))
    refused = {
        "an unknown field": {"name": "a", "ackdeadline": "1s"},
        "a duration without a unit": {"name": "a", "ack_deadline": "30"},
        "an unknown push format": {"name": "a", "push": {"endpoint": "http://h/", "format": "xml"}},
        "a start that is no position": {"name": "a", "start": "yesterday"},
        "a name with capitals": {"name": "Orders"},
        "no name": {"event_types": ["order.*"]},
    }
    accepted = [case for case, entry in refused.items() if validator.is_valid({"subscriptions": [entry]})]
    if accepted:
        fail(where, f"the schema accepts what apply refuses: {', '.join(accepted)}")
    else:
        print(f"  ok   {where}: refuses {len(refused)} kinds of bad entries")


def check_subscriptions_without_schema(where, doc):
    """Field names from the proto, and the values' forms, when the JSON Schema is missing."""
    for field in sorted(set(doc) - {"subscriptions"}):
        fail(where, f"unknown top-level field {field!r}")
    allowed = {}
    for message in ("Subscription", "PushConfig", "SinkConfig"):
        fields = proto_fields(message)
        allowed[message] = fields - OUTPUT_ONLY if fields is not None else None

    def check_fields(at, mapping, message):
        if not isinstance(mapping, dict):
            fail(where, f"{at} must be a mapping")
            return False
        if allowed[message] is not None:
            for field in sorted(set(mapping) - allowed[message]):
                fail(where, f"{at}: {field!r} is not a field of {message}")
        for field in sorted(set(mapping) & DURATION_FIELDS):
            if not isinstance(mapping[field], str) or not DURATION.match(mapping[field]):
                fail(where, f"{at}.{field}: {mapping[field]!r} is not a duration such as 30s")
        return True

    for index, subscription in enumerate(doc["subscriptions"]):
        at = f"subscriptions[{index}]"
        if not check_fields(at, subscription, "Subscription"):
            continue
        name = subscription.get("name")
        if not isinstance(name, str) or not SUBSCRIPTION_NAME.match(name):
            fail(where, f"{at}.name {name!r} is not a subscription name ([a-z0-9][a-z0-9._-]*)")
        start = subscription.get("start")
        if start is not None and start not in ("earliest", "latest"):
            try:
                datetime.datetime.fromisoformat(str(start).replace("Z", "+00:00"))
            except ValueError:
                fail(where, f"{at}.start {start!r} is not earliest, latest or an RFC 3339 time")
        if "push" in subscription and check_fields(f"{at}.push", subscription["push"], "PushConfig"):
            if subscription["push"].get("format", "binary") not in ("binary", "structured"):
                fail(where, f"{at}.push.format is not binary or structured")
        if "sink" in subscription:
            check_fields(f"{at}.sink", subscription["sink"], "SinkConfig")


def check_gateway_toml(file, text):
    where = relative(file)
    if tomllib is None:
        print(f"  note {where}: not parsed (Python 3.11 or newer has tomllib)")
        return None
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        fail(where, f"does not parse as TOML: {error}")
        return None
    if "database_url" in config:
        fail(where, "database_url holds a password: it belongs in the Secret, not the ConfigMap")
    for index, token in enumerate(config.get("tokens") or []):
        if not re.fullmatch(r"[0-9a-fA-F]{64}", str(token.get("sha256", ""))):
            fail(where, f"tokens[{index}].sha256 must be 64 hex digits")
    print(f"  ok   {where}: TOML")
    return config


def host_allowed(host, allowed_hosts):
    host = host.lower()
    for entry in allowed_hosts:
        entry = entry.lower()
        if entry == "*" or entry == host or (entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False


def pod_templates(rendered):
    for file, doc in rendered.resources:
        if isinstance(doc, dict) and doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            template = (doc.get("spec") or {}).get("template") or {}
            yield file, doc, template


def containers(pod_spec):
    return (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or [])


def check_wiring(rendered, gateway_configs):
    """The pieces of one kustomization refer to one another correctly."""
    configmaps = dict(rendered.generated)
    for file, doc in rendered.resources:
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            data = doc.get("data") or {}
            configmaps.setdefault(doc["metadata"]["name"], {key: (file, text) for key, text in data.items()})
    templates = list(pod_templates(rendered))
    for file, workload, template in templates:
        where = f"{relative(file)}: {workload['kind']}/{workload['metadata']['name']}"
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels")
        if selector and any(labels.get(k) != v for k, v in selector.items()):
            fail(where, f"selector {selector} does not match the pod labels {labels}")
        spec = template.get("spec") or {}
        volumes = {volume["name"]: volume for volume in spec.get("volumes") or []}
        for volume in volumes.values():
            name = (volume.get("configMap") or {}).get("name")
            if name and name not in configmaps:
                fail(where, f"volume {volume['name']} names ConfigMap {name}, which this kustomization does not make")
        for container in containers(spec):
            at = f"{where} container {container['name']}"
            ports = {port.get("name"): port["containerPort"] for port in container.get("ports") or []}
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(probe_name) or {}
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    port = (probe.get(kind) or {}).get("port")
                    if port is not None and port not in ports and port not in ports.values():
                        fail(at, f"{probe_name} probes port {port}, which the container does not declare")
            mounts = {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts") or []}
            for mount_name in mounts.values():
                if mount_name not in volumes:
                    fail(at, f"mounts volume {mount_name}, which the pod does not have")
            for env in container.get("env") or []:
                if env["name"] != "OUTBOX_CONFIG" or "value" not in env:
                    continue
                config_path = Path(env["value"])
                volume = volumes.get(mounts.get(str(config_path.parent)), {})
                data = configmaps.get((volume.get("configMap") or {}).get("name"))
                if data is None or config_path.name not in data:
                    fail(at, f"OUTBOX_CONFIG is {config_path}, which no mounted ConfigMap provides")
                    continue
                config_file = data[config_path.name][0]
                config = gateway_configs.get(config_file) or {}
                for key, port_name in (("listen", "grpc"), ("metrics_listen", "metrics"), ("console_listen", "console")):
                    value = str(config.get(key, "off"))
                    port = value.rpartition(":")[2]
                    if value != "off" and (not port.isdigit() or ports.get(port_name) != int(port)):
                        fail(at, f"{key} = {value!r} in {relative(config_file)}, but the {port_name} port is {ports.get(port_name)}")
    for file, doc in rendered.resources:
        if not isinstance(doc, dict) or doc.get("kind") not in ("Service", "PodDisruptionBudget"):
            continue
        where = f"{relative(file)}: {doc['kind']}/{doc['metadata']['name']}"
        spec = doc.get("spec") or {}
        selector = spec.get("selector") or {}
        if doc["kind"] == "PodDisruptionBudget":
            selector = selector.get("matchLabels") or {}
        matched = [
            (template, workload) for _, workload, template in templates
            if all(((template.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())
        ]
        if not matched:
            fail(where, f"selector {selector} matches no pod template of this kustomization")
        elif len(matched) > 1:
            names = ", ".join(f"{w['kind']}/{w['metadata']['name']}" for _, w in matched)
            fail(where, f"selector {selector} matches several workloads: {names}")
        elif doc["kind"] == "Service":
            template = matched[0][0]
            ports = {}
            for container in (template.get("spec") or {}).get("containers") or []:
                ports.update({port.get("name"): port["containerPort"] for port in container.get("ports") or []})
            for port in spec.get("ports") or []:
                target = port.get("targetPort", port.get("port"))
                if target not in ports and target not in ports.values():
                    fail(where, f"port {port.get('name')} targets {target}, which the pods do not declare")


def secret_references(rendered):
    for file, _, template in pod_templates(rendered):
        for container in containers(template.get("spec") or {}):
            for env in container.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    yield file, container["name"], ref["name"], ref["key"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default=str(REPO / "deploy/kubernetes"))
    parser.add_argument(
        "--kubernetes-version",
        default=kv_utils.latest_version(),
        help="Kubernetes version whose schemas to use (default: the latest kubernetes-validate ships)",
    )
    args = parser.parse_args()
    root = Path(args.directory).resolve()
    version = args.kubernetes_version
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, version, True)
    except kv_utils.VersionNotSupportedError:
        sys.exit(f"validate-kubernetes: kubernetes-validate {kubernetes_validate.__version__} has no schemas for Kubernetes {version}")
    print(
        f"kubernetes-validate {kubernetes_validate.__version__}: "
        f"Kubernetes {version} schemas, strict; checking {relative(root)}"
    )
    if not root.is_dir():
        sys.exit(f"validate-kubernetes: {root} is not a directory")

    files = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    seen = set()
    renders = [render(p.parent, seen) for p in files if p.name == "kustomization.yaml"]

    # Each resource once, whether listed by a kustomization or not (the examples); the
    # files generators embed are checked below.
    embedded = {
        file for rendered in renders for data in rendered.generated.values() for file, _ in data.values()
    }
    seen |= embedded
    for file in files:
        if file.name == "kustomization.yaml" or file in embedded:
            continue
        for doc in load_documents(file) or []:
            validate_resource(file, doc, version)
    # The generated ConfigMaps, and the files they embed, once each (an overlay renders
    # its base again).
    gateway_configs, endpoints, checked = {}, [], set()
    for rendered in renders:
        for name, data in rendered.generated.items():
            sources = tuple(sorted(str(file) for file, _ in data.values()))
            if (name, sources) in checked:
                continue
            checked.add((name, sources))
            configmap = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name},
                "data": {key: text for key, (_, text) in data.items()},
            }
            validate_resource(rendered.directory / "kustomization.yaml", configmap, version)
            for key, (file, text) in data.items():
                if file.suffix == ".toml":
                    gateway_configs[file] = check_gateway_toml(file, text)
                elif key == "subscriptions.yaml":
                    endpoints += [(file, at, url) for at, url in check_subscriptions(file, text)]

    # The repository's example file, and that the schema refuses what apply refuses.
    example = REPO / "examples/subscriptions.yaml"
    check_subscriptions(example, example.read_text())
    check_schema_refusals()

    for file, at, url in endpoints:
        host = urllib.parse.urlsplit(url).hostname or ""
        for config_file, config in gateway_configs.items():
            if config is None:
                continue
            allowed = (config.get("push") or {}).get("allowed_hosts") or []
            if not host_allowed(host, allowed):
                fail(relative(file), f"{at}: host {host} is not in [push] allowed_hosts of {relative(config_file)}")

    documented = set()
    for file in files:
        if file in embedded:
            continue
        for doc in load_documents(file) or []:
            if isinstance(doc, dict) and doc.get("kind") == "Secret":
                keys = set(doc.get("stringData") or {}) | set(doc.get("data") or {})
                documented |= {(doc["metadata"]["name"], key) for key in keys}
    for rendered in renders:
        check_wiring(rendered, gateway_configs)
        for file, container, name, key in secret_references(rendered):
            if (name, key) not in documented:
                fail(relative(file), f"container {container} reads key {key} of Secret {name}, which no example Secret documents")

    unlisted = [relative(f) for f in files if f.resolve() not in seen and f.name != "kustomization.yaml"]
    if unlisted:
        print(f"  note not in any kustomization (validated on their own): {', '.join(unlisted)}")
    if fail.count:
        print(f"{fail.count} problem(s) found")
        return 1
    print("all manifests are valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
