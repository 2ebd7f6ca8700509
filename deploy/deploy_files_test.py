"""Checks the deployment files: each parses, says what the others assume, and
uses only ServiceConfig fields and enum values that the wire contract has.

The .proto is read as text (no generated code), so this test needs only
Python and Debian's python3-yaml. Where the tools are installed it also runs
`systemd-analyze verify` on the units and kubectl's own decoding on the
manifest, both offline; where they are not, those tests are skipped
(SPECSTATE_REQUIRE_TOOLS=1, as deploy/check.sh sets, makes that a failure).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import unittest

import yaml

PROTO = "proto/specstate/v1/specstate.proto"
DOCKERFILE = "deploy/container/Dockerfile"
KUBERNETES = "deploy/kubernetes/specstate.yaml"
UNIT = "deploy/systemd/specstated.service"
MPS_UNIT = "deploy/systemd/nvidia-cuda-mps.service"
DOCKERIGNORE = ".dockerignore"
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


def require_tool(test, name):
    """The tool's path; skips the test where it is missing, unless
    SPECSTATE_REQUIRE_TOOLS=1."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("SPECSTATE_REQUIRE_TOOLS") == "1":
            test.fail("%s is not installed (SPECSTATE_REQUIRE_TOOLS=1)" % name)
        test.skipTest("%s is not installed" % name)
    return path


def unit_env(unit):
    """{NAME: value} of a unit's Environment= lines."""
    env = {}
    for line in unit.get("Service", {}).get("Environment", []):
        for item in shlex.split(line):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def health_deadline_ms(command):
    """The deadline specstate-health uses for this command line."""
    return int(flag(command, "timeout_ms") or 2000)  # its --timeout_ms default


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
                          "submit_spin_us", "stuck_stream_ms", "keeper", "discard_kept_pools",
                          "host_tier_bytes"})
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
        cls.init_containers = {c["name"]: c for c in cls.pod.get("initContainers", [])}
        cls.all_containers = dict(cls.init_containers, **cls.containers)
        # The keeper holds memory descriptors only: no GPU, no CUDA.
        cls.keepers = {name: c for name, c in cls.init_containers.items()
                       if c.get("command", [""])[0] == "specstate-keeper"}
        cls.cuda_containers = {name: c for name, c in cls.all_containers.items()
                               if name not in cls.keepers}

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
        for name, container in self.cuda_containers.items():
            used = [c["name"] for c in container["resources"]["claims"]]
            self.assertEqual(used, claims, name)
        # CUDA IPC handles do not open across PID namespaces.
        self.assertIs(self.pod.get("shareProcessNamespace"), True)

    def test_one_non_root_uid_matching_the_image(self):
        security = self.pod["securityContext"]
        self.assertIs(security.get("runAsNonRoot"), True)
        image_user = dict(dockerfile_instructions(read(DOCKERFILE)))["USER"]
        self.assertEqual(str(security["runAsUser"]), image_user.split(":")[0])
        for name, container in self.all_containers.items():
            self.assertNotIn("runAsUser", container.get("securityContext", {}), name)

    def test_probes_ask_the_configured_socket(self):
        specstated = self.containers["specstated"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = specstated[probe]["exec"]["command"]
            self.assertEqual(command[0], "specstate-health", probe)
            self.assertEqual(flag(command, "addr"), self.config()["listen"], probe)
            # kubelet must not give up on the probe before the probe gives up
            # on the server (timeoutSeconds defaults to 1).
            self.assertGreater(specstated[probe].get("timeoutSeconds", 1) * 1000,
                               health_deadline_ms(command), probe)

    def test_liveness_restarts_and_readiness_gates(self):
        specstated = self.containers["specstated"]
        liveness, readiness = specstated["livenessProbe"], specstated["readinessProbe"]
        # specstate-health fails on NOT_SERVING: both probes fail then, and
        # readiness (which takes the pod out of Services) acts before
        # liveness restarts the container.
        self.assertEqual(liveness["exec"]["command"], readiness["exec"]["command"])
        self.assertLess(readiness["periodSeconds"] * readiness.get("failureThreshold", 3),
                        liveness["periodSeconds"] * liveness.get("failureThreshold", 3))
        self.assertIn("startupProbe", specstated)

    def test_gpu_backend_is_explicit(self):
        # AUTO falls back to the CPU, with the pools in /dev/shm.
        args = self.containers["specstated"]["args"]
        self.assertEqual(flag(args, "backend"), "cuda")
        self.assertEqual(self.config()["layout"].get("backend"), "CUDA")

    def test_mps_control_daemon_sidecar(self):
        sidecars = [c for c in self.init_containers.values()
                    if "nvidia-cuda-mps-control -f" in " ".join(c.get("command", []))]
        self.assertEqual(len(sidecars), 1)
        sidecar = sidecars[0]
        # A native sidecar: started (its startup probe passed) before the
        # containers, kept running beside them.
        self.assertEqual(sidecar.get("restartPolicy"), "Always")
        self.assertIn("startupProbe", sidecar)
        self.assertEqual([c["name"] for c in sidecar["resources"]["claims"]],
                         [c["name"] for c in self.pod["resourceClaims"]])
        self.assertNotIn("runAsUser", sidecar.get("securityContext", {}))

    def test_mps_directories_are_shared(self):
        def env(container):
            return {e["name"]: e.get("value") for e in container.get("env", [])}
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        pipe = env(self.containers["specstated"]).get("CUDA_MPS_PIPE_DIRECTORY")
        log = env(self.containers["specstated"]).get("CUDA_MPS_LOG_DIRECTORY")
        self.assertTrue(pipe and log)
        for name, container in self.cuda_containers.items():
            self.assertEqual(env(container).get("CUDA_MPS_PIPE_DIRECTORY"), pipe, name)
            self.assertEqual(env(container).get("CUDA_MPS_LOG_DIRECTORY"), log, name)
        # The pipe directory lies in one volume, mounted at one path everywhere.
        mounts = set()
        for name, container in self.cuda_containers.items():
            found = [(m["name"], m["mountPath"]) for m in container["volumeMounts"]
                     if (pipe + "/").startswith(m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(found), 1, name)
            self.assertIn("emptyDir", volumes[found[0][0]], name)
            mounts.add(found[0])
        self.assertEqual(len(mounts), 1, mounts)

    def test_keeper_sidecar_holds_the_pools(self):
        # One keeper, a native sidecar (up before specstated, beside it while
        # its container restarts), on a socket in the shared socket volume,
        # the one specstated's config names.
        self.assertEqual(len(self.keepers), 1)
        keeper = next(iter(self.keepers.values()))
        self.assertEqual(keeper.get("restartPolicy"), "Always")
        self.assertIn("startupProbe", keeper)
        socket = flag(keeper["command"], "socket")
        self.assertEqual(os.path.dirname(socket), SOCKET_DIR)
        mounts = {m["name"]: m["mountPath"] for m in keeper["volumeMounts"]}
        self.assertEqual(mounts.get("socket"), SOCKET_DIR)
        self.assertIn(socket, " ".join(keeper["startupProbe"]["exec"]["command"]))
        self.assertEqual(self.config().get("keeper"), socket)
        self.assertIsNone(flag(self.containers["specstated"]["args"], "keeper"))
        # It never touches the GPU: no claim, and it starts after MPS's sidecar
        # only by its place (init containers start in order).
        self.assertNotIn("claims", keeper.get("resources", {}))

    def test_every_container_has_requests_and_a_memory_limit(self):
        for name, container in self.all_containers.items():
            resources = container.get("resources", {})
            self.assertTrue(resources.get("requests", {}).get("cpu"), name)
            self.assertTrue(resources.get("requests", {}).get("memory"), name)
            self.assertTrue(resources.get("limits", {}).get("memory"), name)

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
        self.assertEqual(self.value("Type"), "notify")  # specstated sends READY=1
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

    def test_keeps_the_pools_in_the_file_descriptor_store(self):
        # specstated stores two descriptors (the pools and their bookkeeping)
        # with FDSTORE=1, which the service manager accepts only with a store;
        # its READY=1 and FDSTORE messages come from the main process.
        self.assertGreaterEqual(int(self.value("FileDescriptorStoreMax")), 2)
        self.assertIn(self.service.get("NotifyAccess", ["main"])[-1], ("main", "all"))
        # RemoveIPC would not touch memfds, but a restart must not wait long:
        # the schedulers wait (their clients retry for up to a minute).
        restart_sec = self.value("RestartSec")
        seconds = (float(restart_sec[:-2]) / 1000 if restart_sec.endswith("ms")
                   else float(restart_sec.rstrip("s")))
        self.assertLessEqual(seconds, 1.0)

    def test_keeps_gpu_and_shared_memory(self):
        for key in ("PrivateDevices", "RemoveIPC", "DevicePolicy", "PrivateTmp"):
            for value in self.service.get(key, []):
                self.assertIn(value, ("no", "false", "auto", ""), key)

    def test_runs_after_and_with_the_mps_daemon(self):
        mps = os.path.basename(MPS_UNIT)
        self.assertIn(mps, " ".join(self.unit["Unit"].get("Requires", [])).split())
        self.assertIn(mps, " ".join(self.unit["Unit"].get("After", [])).split())


class MpsUnitTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.unit = parse_unit(read(MPS_UNIT))
        cls.service = cls.unit.get("Service", {})
        cls.specstated = parse_unit(read(UNIT))

    def test_forking_control_daemon(self):
        self.assertEqual(self.service["Type"][-1], "forking")
        args = shlex.split(self.service["ExecStart"][-1])
        self.assertEqual(os.path.basename(args[0]), "nvidia-cuda-mps-control")
        self.assertEqual(args[1:], ["-d"])
        self.assertIn("quit", self.service["ExecStop"][-1])
        self.assertIn("multi-user.target", self.unit["Install"]["WantedBy"])

    def test_same_user_as_specstated(self):
        # A daemon of a non-root user serves only that user's clients.
        self.assertEqual(self.service["User"], self.specstated["Service"]["User"])

    def test_same_mps_directories_as_specstated(self):
        env, theirs = unit_env(self.unit), unit_env(self.specstated)
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            self.assertTrue(env.get(key), key)
            self.assertEqual(theirs.get(key), env[key], key)
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        self.assertEqual(pipe, "/run/" + self.service["RuntimeDirectory"][-1])
        self.assertEqual(env["CUDA_MPS_LOG_DIRECTORY"],
                         "/var/log/" + self.service["LogsDirectory"][-1])
        self.assertEqual(os.path.dirname(self.service["PIDFile"][-1]), pipe)
        # specstated's ProtectSystem=strict leaves the pipe directory writable.
        writable = " ".join(self.specstated["Service"].get("ReadWritePaths", [])).split()
        self.assertIn(pipe, [w.lstrip("-") for w in writable])


class SystemdAnalyzeTest(unittest.TestCase):
    """systemd-analyze verify on copies of the units whose Exec lines point at
    stub executables: verify wants the binaries to exist, and they are not
    installed here. It works without a running systemd. It exits 0 on unknown
    keys and bad values too, printing them, so any output is a failure."""

    def test_units_verify(self):
        tool = require_tool(self, "systemd-analyze")
        with tempfile.TemporaryDirectory() as tmp:
            os.mkdir(os.path.join(tmp, "bin"))
            for name in ("specstated", "nvidia-cuda-mps-control"):
                stub = os.path.join(tmp, "bin", name)
                with open(stub, "w") as f:
                    f.write("#!/bin/sh\n")
                os.chmod(stub, 0o755)
            units = []
            for path in (UNIT, MPS_UNIT):
                text = re.sub(r"/usr/(local/)?bin/(specstated|nvidia-cuda-mps-control)\b",
                              lambda m: os.path.join(tmp, "bin", m.group(2)), read(path))
                units.append(os.path.join(tmp, os.path.basename(path)))
                with open(units[-1], "w") as f:
                    f.write(text)
            result = subprocess.run([tool, "verify", "--man=no"] + units,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    universal_newlines=True, timeout=120)
        self.assertEqual((result.returncode, result.stdout.strip()), (0, ""))


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

    def test_copies_the_binaries(self):
        copied = [os.path.basename(arg) for word, args in self.instructions
                  if word == "COPY" for arg in args.split()]
        for binary in ("specstated", "specstate-health", "specstatectl", "specstate-keeper"):
            self.assertIn(binary, copied)

    def test_installs_the_metrics_libraries(self):
        # The runtime stage installs the Debian packages of what `ldd` lists
        # for the binaries the build stage made, so prometheus-cpp and
        # civetweb (--metrics_listen) come with specstated as long as the
        # build stage builds against them: tools/install_deps.sh installs
        # prometheus-cpp-dev, and the runtime list is made by ldd + dpkg -S.
        runs = " ".join(args for word, args in self.instructions if word == "RUN")
        self.assertIn("tools/install_deps.sh", runs)
        self.assertIn("ldd", runs)
        self.assertIn("dpkg -S", runs)
        self.assertIn("xargs -a /tmp/runtime-packages apt-get install", runs)
        self.assertIn("prometheus-cpp-dev", read("tools/install_deps.sh"))

    def test_health_check_uses_the_socket(self):
        command = json.loads(self.last("HEALTHCHECK").split("CMD", 1)[1])
        self.assertEqual(command[0], "specstate-health")
        self.assertEqual(flag(command, "addr"), SOCKET_ADDR)
        # The builder must not kill the check before its own deadline.
        timeout = re.search(r"--timeout=(\d+)s", self.last("HEALTHCHECK"))
        self.assertTrue(timeout)
        self.assertGreater(int(timeout.group(1)) * 1000, health_deadline_ms(command))

    def test_socket_directory_is_a_volume(self):
        self.assertIn(SOCKET_DIR, json.loads(self.last("VOLUME")))

    def stages(self):
        """[(FROM arguments, [(INSTRUCTION, arguments)])] per stage."""
        stages = []
        for word, args in self.instructions:
            if word == "FROM":
                stages.append((args, []))
            elif stages:
                stages[-1][1].append((word, args))
        return stages

    def test_multi_stage_build_with_bazel(self):
        stages = self.stages()
        self.assertEqual(len(stages), 2)
        (build_from, build), (runtime_from, runtime) = stages
        self.assertTrue(build_from.endswith(" AS build"), build_from)
        runs = " ".join(args for word, args in build if word == "RUN")
        # The same package list as CI's, and the three binaries from Bazel.
        self.assertIn("tools/install_deps.sh", runs)
        for target in ("//server:specstated", "//deploy/health:specstate-health",
                       "//client/cli:specstatectl"):
            self.assertIn(target, runs)
        self.assertIn("SPECSTATE_CUDA=${CUDA}", runs)
        self.assertIn(("ARG", "CUDA=0"), build)
        # The runtime stage takes binaries, not the toolchain.
        copies = [args for word, args in runtime if word == "COPY"]
        self.assertTrue(copies and all(c.startswith("--from=build ") for c in copies), copies)
        self.assertIn(("USER", self.last("USER")), runtime)

    def test_context_leaves_out_local_files(self):
        ignored = [line.strip() for line in read(DOCKERIGNORE).splitlines()
                   if line.strip() and not line.startswith("#")]
        # user.bazelrc names this machine's disk cache; bazel-* are links
        # out of the tree.
        for pattern in (".git", "bazel-*", "user.bazelrc"):
            self.assertIn(pattern, ignored)


class KubectlTest(unittest.TestCase):
    """kubectl with no cluster: `apply/create --dry-run=client` need the API
    server's discovery even with --validate=false, so what runs offline is
    `kubectl kustomize` (parses every document) and `kubectl set env --local`,
    which decodes the Deployment into kubectl's own Go types and encodes it
    again: a field kubectl does not know comes back missing, a value of the
    wrong type is an error. kubectl 1.32 has no types for resource.k8s.io/v1,
    so the ResourceClaimTemplate is only parsed."""

    MARK = "SPECSTATE_KUBECTL_CHECK"

    def kubectl(self, *args):
        tool = require_tool(self, "kubectl")
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, HOME=home, KUBECONFIG=os.devnull)
            result = subprocess.run([tool] + list(args), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, universal_newlines=True,
                                    env=env, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result.stdout

    def test_kustomize_parses_every_document(self):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(KUBERNETES, tmp)
            with open(os.path.join(tmp, "kustomization.yaml"), "w") as f:
                f.write("resources:\n- %s\n" % os.path.basename(KUBERNETES))
            out = self.kubectl("kustomize", tmp)
        kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
        self.assertEqual(kinds, ["ConfigMap", "Deployment", "ResourceClaimTemplate"])

    def test_deployment_round_trips_through_kubectl_types(self):
        version = json.loads(self.kubectl("version", "--client", "-o", "json"))
        minor = int(re.match(r"\d+", version["clientVersion"]["minor"]).group())
        if minor < 29:  # native sidecars (initContainers[].restartPolicy): 1.28+
            self.skipTest("kubectl 1.%d predates fields the manifest uses" % minor)
        deployment = [d for d in yaml.safe_load_all(read(KUBERNETES))
                      if d and d["kind"] == "Deployment"][0]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "deployment.json")
            with open(path, "w") as f:
                json.dump(deployment, f)
            out = json.loads(self.kubectl("set", "env", "--local", "-o", "json", "-f", path,
                                          self.MARK + "=1"))
        for pod in (out["spec"]["template"]["spec"],):
            for key in ("initContainers", "containers"):
                for container in pod.get(key, []):
                    container["env"] = [e for e in container["env"] if e["name"] != self.MARK]
        self.assertEqual(self.missing(deployment, out, "$"), [])

    def missing(self, given, got, path):
        """Paths in `given` that `got` lacks or holds another value at."""
        if isinstance(given, dict):
            if not isinstance(got, dict):
                return [path]
            return [p for k, v in given.items()
                    for p in (self.missing(v, got[k], "%s.%s" % (path, k)) if k in got
                              else ["%s.%s" % (path, k)])]
        if isinstance(given, list):
            if not isinstance(got, list) or len(got) != len(given):
                return [path]
            return [p for i, v in enumerate(given)
                    for p in self.missing(v, got[i], "%s[%d]" % (path, i))]
        return [] if given == got or str(given) == str(got) else ["%s: %r -> %r" % (path, given, got)]


if __name__ == "__main__":
    unittest.main()
