"""Checks the deployment files: each parses, says what the others assume, and
uses only ServiceConfig fields and enum values that the wire contract has.

The .proto is read as text (no generated code), so this test needs only
Python and Debian's python3-yaml.
"""

import json
import os
import re
import shlex
import unittest

import yaml

PROTO = "proto/specstate/v1/specstate.proto"
DOCKERFILE = "deploy/container/Dockerfile"
KUBERNETES = "deploy/kubernetes/specstate.yaml"
UNIT = "deploy/systemd/specstated.service"
UNIT_CONFIG = "deploy/systemd/specstate.json"
SYSUSERS = "deploy/systemd/specstate.sysusers"

SOCKET_DIR = "/run/specstate"
SOCKET_ADDR = "unix:///run/specstate/specstate.sock"
METRICS_PATH = "/metrics"  # where specstated's --metrics_listen serves them

SCALARS = {
    "double": float, "float": float, "bool": bool, "string": str, "bytes": str,
    "int32": int, "int64": int, "uint32": int, "uint64": int, "sint32": int,
    "sint64": int, "fixed32": int, "fixed64": int, "sfixed32": int, "sfixed64": int,
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _blocks(text, keyword):
    """{name: body} of every top-level `keyword Name { body }` block."""
    blocks = {}
    for match in re.finditer(r"\b%s\s+(\w+)\s*\{" % keyword, text):
        depth, i = 1, match.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        blocks[match.group(1)] = text[match.end():i - 1]
    return blocks


def parse_proto(text):
    """(messages, enums): messages map name -> {field: (type, repeated)},
    enums map name -> set of value names."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    enums = {name: set(re.findall(r"(\w+)\s*=\s*-?\d+\s*;", body))
             for name, body in _blocks(text, "enum").items()}
    messages = {}
    for name, body in _blocks(text, "message").items():
        fields = {}
        for repeated, ftype, fname in re.findall(
                r"(repeated\s+)?(map\s*<[^>]*>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*[;\[]", body):
            fields[fname] = (ftype, bool(repeated))
        messages[name] = fields
    return messages, enums


def json_name(field):
    head, *rest = field.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


class ProtoJsonChecker:
    """Checks a JSON value against a proto3 message as protobuf's JSON parser
    does by default (unknown fields and bad enum names are errors; field names
    may be proto names or lowerCamelCase), and a little stricter: numbers must
    be JSON numbers, not the quoted numbers protobuf also takes."""

    def __init__(self, proto_text):
        self.messages, self.enums = parse_proto(proto_text)

    def errors(self, value, message, path="$"):
        if not isinstance(value, dict):
            return ["%s: expected an object for %s" % (path, message)]
        fields = self.messages[message]
        by_json_name = {json_name(f): f for f in fields}
        errors = []
        for key, item in value.items():
            field = key if key in fields else by_json_name.get(key)
            if field is None:
                errors.append("%s.%s: no such field in %s" % (path, key, message))
                continue
            ftype, repeated = fields[field]
            items = item if repeated else [item]
            if repeated and not isinstance(item, list):
                errors.append("%s.%s: expected a list" % (path, key))
                continue
            for element in items:
                errors += self._value_errors(element, ftype, "%s.%s" % (path, key))
        return errors

    def _value_errors(self, value, ftype, path):
        if ftype in self.messages:
            return self.errors(value, ftype, path)
        if ftype in self.enums:
            if isinstance(value, str) and value not in self.enums[ftype]:
                return ["%s: %r is not a %s (%s)" % (path, value, ftype,
                                                      ", ".join(sorted(self.enums[ftype])))]
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                return ["%s: expected a %s name" % (path, ftype)]
            return []
        expected = SCALARS.get(ftype)
        if expected is None:
            return []  # maps and well-known types: not used by ServiceConfig
        ok = (isinstance(value, expected) and not isinstance(value, bool)) or (
            expected is bool and isinstance(value, bool)) or (
            expected is float and isinstance(value, int) and not isinstance(value, bool))
        return [] if ok else ["%s: expected %s, got %r" % (path, ftype, value)]


def parse_unit(text):
    """{section: {key: [values]}} of a systemd unit file."""
    sections, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if current is None or not sep:
            raise ValueError("not a unit file line: %r" % line)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def dockerfile_instructions(text):
    """[(INSTRUCTION, arguments)] with continuation lines joined."""
    text = re.sub(r"\\\n", " ", text)
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def flag(args, name):
    """The value of --name=VALUE in args, or None."""
    for arg in args:
        if arg.startswith("--%s=" % name):
            return arg.split("=", 1)[1]
    return None


class ProtoParserTest(unittest.TestCase):
    """The checker below is only as good as this parser: pin what it reads."""

    def test_reads_service_config_and_layout(self):
        messages, enums = parse_proto(read(PROTO))
        self.assertEqual(set(messages["ServiceConfig"]),
                         {"layout", "listen", "default_lease_ms", "max_lease_ms",
                          "submit_spin_us", "stuck_stream_ms"})
        self.assertEqual(messages["ServiceConfig"]["layout"], ("Layout", False))
        self.assertIn("mamba_block_size", messages["Layout"])
        self.assertEqual(messages["Layout"]["backend"], ("Backend", False))
        self.assertIn("CUDA", enums["Backend"])
        self.assertIn("ALIGN", enums["CacheMode"])
        self.assertEqual(messages["PoolView"]["shape"], ("int64", True))

    def test_checker(self):
        checker = ProtoJsonChecker(read(PROTO))
        self.assertEqual(checker.errors({"layout": {"numLayers": 2}, "listen": "x"},
                                        "ServiceConfig"), [])
        self.assertTrue(checker.errors({"layout": {"num_layer": 2}}, "ServiceConfig"))
        self.assertTrue(checker.errors({"listen_addr": "x"}, "ServiceConfig"))
        self.assertTrue(checker.errors({"layout": {"cache_mode": "ALIGNED"}}, "ServiceConfig"))
        self.assertTrue(checker.errors({"layout": []}, "ServiceConfig"))
        self.assertTrue(checker.errors({"layout": {"num_heads": "32"}}, "ServiceConfig"))


class KubernetesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        docs = [d for d in yaml.safe_load_all(read(KUBERNETES)) if d is not None]
        cls.by_kind = {d["kind"]: d for d in docs}
        cls.kinds = sorted(d["kind"] for d in docs)
        cls.deployment = cls.by_kind.get("Deployment")
        cls.pod = cls.deployment["spec"]["template"]["spec"] if cls.deployment else {}
        cls.containers = {c["name"]: c for c in cls.pod.get("containers", [])}

    def test_kinds(self):
        self.assertEqual(self.kinds, ["ConfigMap", "Deployment", "ResourceClaimTemplate"])
        for doc in self.by_kind.values():
            self.assertTrue(doc.get("apiVersion"), doc["kind"])
            self.assertTrue(doc.get("metadata", {}).get("name"), doc["kind"])

    def test_selector_matches_template(self):
        labels = self.deployment["spec"]["template"]["metadata"]["labels"]
        for key, value in self.deployment["spec"]["selector"]["matchLabels"].items():
            self.assertEqual(labels.get(key), value)

    def test_containers(self):
        self.assertEqual(set(self.containers), {"specstated", "scheduler"})
        for container in self.containers.values():
            self.assertTrue(container.get("image"), container["name"])

    def test_volumes(self):
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        self.assertEqual(volumes["socket"]["emptyDir"].get("medium"), "Memory")
        self.assertEqual(volumes["shm"]["emptyDir"].get("medium"), "Memory")
        self.assertEqual(volumes["config"]["configMap"]["name"],
                         self.by_kind["ConfigMap"]["metadata"]["name"])
        # Both containers see the same socket directory and the same /dev/shm.
        for name, container in self.containers.items():
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            self.assertEqual(mounts.get("socket"), SOCKET_DIR, name)
            self.assertEqual(mounts.get("shm"), "/dev/shm", name)
            for mount in mounts:
                self.assertIn(mount, volumes, name)

    def test_shared_gpu_and_process_namespace(self):
        claims = [c["name"] for c in self.pod["resourceClaims"]]
        template = self.by_kind["ResourceClaimTemplate"]["metadata"]["name"]
        self.assertEqual([c["resourceClaimTemplateName"] for c in self.pod["resourceClaims"]],
                         [template])
        for name, container in self.containers.items():
            used = [c["name"] for c in container["resources"]["claims"]]
            self.assertEqual(used, claims, name)
        # CUDA IPC handles do not open across PID namespaces.
        self.assertIs(self.pod.get("shareProcessNamespace"), True)

    def test_one_non_root_uid_matching_the_image(self):
        security = self.pod["securityContext"]
        self.assertIs(security.get("runAsNonRoot"), True)
        image_user = dict(dockerfile_instructions(read(DOCKERFILE)))["USER"]
        self.assertEqual(str(security["runAsUser"]), image_user.split(":")[0])
        for name, container in self.containers.items():
            self.assertNotIn("runAsUser", container.get("securityContext", {}), name)

    def test_probes_ask_the_configured_socket(self):
        specstated = self.containers["specstated"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = specstated[probe]["exec"]["command"]
            self.assertEqual(command[0], "specstate-health", probe)
            self.assertEqual(flag(command, "addr"), self.config()["listen"], probe)

    def test_config_map_is_the_config_file(self):
        specstated = self.containers["specstated"]
        mount = [m for m in specstated["volumeMounts"] if m["name"] == "config"][0]
        path = flag(specstated["args"], "config")
        self.assertEqual(os.path.dirname(path), mount["mountPath"])
        self.assertIn(os.path.basename(path), self.by_kind["ConfigMap"]["data"])

    def test_config_map_json_is_a_service_config(self):
        config = self.config()
        self.assertEqual(ProtoJsonChecker(read(PROTO)).errors(config, "ServiceConfig"), [])
        self.assertEqual(config["listen"], SOCKET_ADDR)

    def test_metrics_port_and_scrape_annotations_agree_with_the_flag(self):
        specstated = self.containers["specstated"]
        listen = flag(specstated["args"], "metrics_listen")
        self.assertTrue(listen, "specstated has no --metrics_listen")
        host, _, port = listen.rpartition(":")
        # The scraper dials the pod IP, which a loopback address does not serve.
        self.assertEqual(host, "0.0.0.0")
        self.assertTrue(port.isdigit() and 0 < int(port) < 65536, port)
        ports = {p["name"]: p for p in specstated.get("ports", [])}
        self.assertEqual(ports["metrics"]["containerPort"], int(port))
        self.assertEqual(ports["metrics"].get("protocol", "TCP"), "TCP")
        annotations = self.deployment["spec"]["template"]["metadata"]["annotations"]
        # Annotation values must be strings: an unquoted true or 9464 is not.
        self.assertEqual(annotations.get("prometheus.io/scrape"), "true")
        self.assertEqual(annotations.get("prometheus.io/port"), port)
        self.assertEqual(annotations.get("prometheus.io/path"), METRICS_PATH)

    def config(self):
        data = self.by_kind["ConfigMap"]["data"]
        self.assertEqual(len(data), 1)
        return json.loads(next(iter(data.values())))


class SystemdTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.unit = parse_unit(read(UNIT))
        cls.service = cls.unit.get("Service", {})

    def value(self, key):
        values = self.service.get(key)
        self.assertTrue(values, "[Service] has no %s=" % key)
        return values[-1]

    def test_required_keys(self):
        self.assertTrue(self.unit["Unit"]["Description"])
        self.assertEqual(self.value("Type"), "simple")
        self.assertEqual(self.value("Restart"), "on-failure")
        self.assertEqual(self.value("RuntimeDirectory"), os.path.basename(SOCKET_DIR))
        self.assertIn("multi-user.target", self.unit["Install"]["WantedBy"])

    def test_dedicated_user_from_sysusers(self):
        user = self.value("User")
        self.assertNotIn(user, ("root", "nobody", "0"))
        self.assertNotIn("yes", self.service.get("DynamicUser", []))
        entries = [line.split() for line in read(SYSUSERS).splitlines()
                   if line.strip() and not line.startswith("#")]
        self.assertIn(["u", user], [e[:2] for e in entries])

    def test_exec_start_reads_the_example_config(self):
        args = shlex.split(self.value("ExecStart"))
        self.assertEqual(os.path.basename(args[0]), "specstated")
        self.assertTrue(os.path.isabs(args[0]))
        self.assertEqual(os.path.basename(flag(args, "config")), os.path.basename(UNIT_CONFIG))

    def test_example_config(self):
        config = json.loads(read(UNIT_CONFIG))
        self.assertEqual(ProtoJsonChecker(read(PROTO)).errors(config, "ServiceConfig"), [])
        self.assertEqual(config["listen"], SOCKET_ADDR)

    def test_keeps_gpu_and_shared_memory(self):
        for key in ("PrivateDevices", "RemoveIPC", "DevicePolicy", "PrivateTmp"):
            for value in self.service.get(key, []):
                self.assertIn(value, ("no", "false", "auto", ""), key)


class DockerfileTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.instructions = dockerfile_instructions(read(DOCKERFILE))

    def last(self, instruction):
        values = [args for word, args in self.instructions if word == instruction]
        self.assertTrue(values, "no %s" % instruction)
        return values[-1]

    def test_entrypoint_is_specstated(self):
        entrypoint = json.loads(self.last("ENTRYPOINT"))
        self.assertEqual(entrypoint, ["specstated"])

    def test_default_listen_is_the_shared_socket(self):
        self.assertEqual(flag(json.loads(self.last("CMD")), "listen"), SOCKET_ADDR)

    def test_non_root_numeric_user(self):
        uid, _, gid = self.last("USER").partition(":")
        self.assertTrue(uid.isdigit() and int(uid) > 0, uid)
        self.assertTrue(not gid or gid.isdigit(), gid)

    def test_copies_both_binaries(self):
        copied = " ".join(args for word, args in self.instructions if word == "COPY").split()
        self.assertIn("specstated", copied)
        self.assertIn("specstate-health", copied)

    def test_installs_the_metrics_libraries(self):
        # What `ldd specstated` lists for --metrics_listen (prometheus-cpp's
        # pull exposer and its HTTP server, civetweb).
        installed = " ".join(args for word, args in self.instructions if word == "RUN").split()
        for package in ("libprometheus-cpp-core1.0", "libprometheus-cpp-pull1.0", "libcivetweb1"):
            self.assertIn(package, installed)

    def test_health_check_uses_the_socket(self):
        command = json.loads(self.last("HEALTHCHECK").split("CMD", 1)[1])
        self.assertEqual(command[0], "specstate-health")
        self.assertEqual(flag(command, "addr"), SOCKET_ADDR)


if __name__ == "__main__":
    unittest.main()
