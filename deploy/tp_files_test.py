"""Checks the tensor-parallel deployment files: one specstated per GPU.

- kubernetes/specstate-tp.yaml: a specstated-r container per GPU (its
  --device=r, its socket in the shared socket directory, its probes on that
  socket), one claim of that many GPUs named by every container, the
  scheduler told every socket in rank order, and the single-GPU manifest's
  conventions (shared socket and /dev/shm volumes, one PID namespace, the
  image's UID);
- systemd/specstated@.service: the instance name is the device and picks the
  socket, the shared runtime directory survives an instance's stop, and the
  rest of [Service] is specstated.service's;
- systemd/specstate-tp.json: a ServiceConfig, the ConfigMap's config, parsed
  by specstated itself through the template's ExecStart.

Shares the parsers of deploy_files_test.py (the single-GPU files' test).
Needs Debian's python3-yaml.
"""

import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
import unittest

import yaml

from deploy_files_test import (DOCKERFILE, PROTO, SYSUSERS, UNIT, ProtoJsonChecker,
                               dockerfile_instructions, flag, parse_unit, read)

KUBERNETES = "deploy/kubernetes/specstate-tp.yaml"
TEMPLATE = "deploy/systemd/specstated@.service"
TP_CONFIG = "deploy/systemd/specstate-tp.json"
SPECSTATED = "server/specstated"

SOCKET_DIR = "/run/specstate"


def socket_of(rank):
    return "unix://%s/specstate-%s.sock" % (SOCKET_DIR, rank)


class KubernetesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        docs = [d for d in yaml.safe_load_all(read(KUBERNETES)) if d is not None]
        cls.by_kind = {d["kind"]: d for d in docs}
        cls.kinds = sorted(d["kind"] for d in docs)
        cls.deployment = cls.by_kind["Deployment"]
        cls.pod = cls.deployment["spec"]["template"]["spec"]
        cls.containers = {c["name"]: c for c in cls.pod["containers"]}
        cls.ranks = sorted((c for c in cls.containers if c.startswith("specstated-")),
                           key=lambda name: int(name.split("-")[1]))

    def test_kinds_and_selector(self):
        self.assertEqual(self.kinds, ["ConfigMap", "Deployment", "ResourceClaimTemplate"])
        labels = self.deployment["spec"]["template"]["metadata"]["labels"]
        for key, value in self.deployment["spec"]["selector"]["matchLabels"].items():
            self.assertEqual(labels.get(key), value)

    def test_one_specstated_per_gpu(self):
        self.assertEqual(self.ranks, ["specstated-%d" % r for r in range(len(self.ranks))])
        self.assertGreaterEqual(len(self.ranks), 2)
        self.assertEqual(set(self.containers), set(self.ranks) | {"scheduler"})
        for r, name in enumerate(self.ranks):
            args = self.containers[name]["args"]
            self.assertEqual(flag(args, "device"), str(r), name)
            self.assertEqual(flag(args, "backend"), "cuda", name)
            self.assertEqual(flag(args, "listen"), socket_of(r), name)
            self.assertTrue(self.containers[name].get("image"), name)

    def test_one_keeper_per_rank(self):
        """Each rank's specstated names a keeper of its own (a native sidecar on
        a socket in the shared directory): its pools survive its container's
        restart."""
        init = {c["name"]: c for c in self.pod.get("initContainers", [])}
        sockets = set()
        for r, name in enumerate(self.ranks):
            socket = flag(self.containers[name]["args"], "keeper")
            self.assertEqual(socket, "%s/keeper-%d.sock" % (SOCKET_DIR, r), name)
            keeper = init["keeper-%d" % r]
            self.assertEqual(keeper["command"][0], "specstate-keeper")
            self.assertEqual(flag(keeper["command"], "socket"), socket)
            self.assertEqual(keeper.get("restartPolicy"), "Always")
            mounts = {m["name"]: m["mountPath"] for m in keeper["volumeMounts"]}
            self.assertEqual(mounts.get("socket"), SOCKET_DIR)
            sockets.add(socket)
        self.assertEqual(len(sockets), len(self.ranks))

    def test_probes_ask_the_ranks_socket(self):
        for r, name in enumerate(self.ranks):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = self.containers[name][probe]["exec"]["command"]
                self.assertEqual(command[0], "specstate-health", (name, probe))
                self.assertEqual(flag(command, "addr"), socket_of(r), (name, probe))

    def test_scheduler_knows_every_rank_in_order(self):
        env = {e["name"]: e["value"] for e in self.containers["scheduler"]["env"]}
        self.assertEqual(env["SPECSTATE_SERVERS"].split(","),
                         [socket_of(r) for r in range(len(self.ranks))])

    def test_one_claim_of_a_gpu_per_rank_named_by_every_container(self):
        template = self.by_kind["ResourceClaimTemplate"]
        requests = template["spec"]["spec"]["devices"]["requests"]
        self.assertEqual(len(requests), 1)
        exactly = requests[0]["exactly"]
        self.assertEqual(exactly["deviceClassName"], "gpu.nvidia.com")
        self.assertEqual(exactly["allocationMode"], "ExactCount")
        self.assertEqual(exactly["count"], len(self.ranks))
        claims = [c["name"] for c in self.pod["resourceClaims"]]
        self.assertEqual([c["resourceClaimTemplateName"] for c in self.pod["resourceClaims"]],
                         [template["metadata"]["name"]])
        for name, container in self.containers.items():
            self.assertEqual([c["name"] for c in container["resources"]["claims"]], claims, name)
            # The same device numbers in every container.
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            self.assertEqual(env.get("CUDA_DEVICE_ORDER"), "PCI_BUS_ID", name)

    def test_shared_volumes_namespace_and_uid(self):
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        self.assertEqual(volumes["socket"]["emptyDir"].get("medium"), "Memory")
        self.assertEqual(volumes["shm"]["emptyDir"].get("medium"), "Memory")
        for name, container in self.containers.items():
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            self.assertEqual(mounts.get("socket"), SOCKET_DIR, name)
            self.assertEqual(mounts.get("shm"), "/dev/shm", name)
            for mount in mounts:
                self.assertIn(mount, volumes, name)
            self.assertNotIn("runAsUser", container.get("securityContext", {}), name)
        self.assertIs(self.pod.get("shareProcessNamespace"), True)
        security = self.pod["securityContext"]
        self.assertIs(security.get("runAsNonRoot"), True)
        image_user = dict(dockerfile_instructions(read(DOCKERFILE)))["USER"]
        self.assertEqual(str(security["runAsUser"]), image_user.split(":")[0])

    def test_every_rank_reads_the_config_map(self):
        data = self.by_kind["ConfigMap"]["data"]
        self.assertEqual(len(data), 1)
        self.assertEqual(volume_config_map(self.pod), self.by_kind["ConfigMap"]["metadata"]["name"])
        for name in self.ranks:
            container = self.containers[name]
            mount = [m for m in container["volumeMounts"] if m["name"] == "config"][0]
            path = flag(container["args"], "config")
            self.assertEqual(os.path.dirname(path), mount["mountPath"], name)
            self.assertIn(os.path.basename(path), data, name)

    def test_config_map_is_the_systemd_config(self):
        config = json.loads(next(iter(self.by_kind["ConfigMap"]["data"].values())))
        self.assertEqual(config, json.loads(read(TP_CONFIG)))


def volume_config_map(pod):
    return [v for v in pod["volumes"] if v["name"] == "config"][0]["configMap"]["name"]


class TemplateUnitTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.unit = parse_unit(read(TEMPLATE))
        cls.service = cls.unit["Service"]
        cls.single = parse_unit(read(UNIT))["Service"]

    def exec_start(self, instance):
        args = shlex.split(self.service["ExecStart"][-1].replace("%i", str(instance)))
        return [a for a in args if a != "$SPECSTATE_FLAGS"]

    def test_the_instance_is_the_device_and_the_socket(self):
        args = self.exec_start(3)
        self.assertTrue(os.path.isabs(args[0]))
        self.assertEqual(os.path.basename(args[0]), "specstated")
        self.assertEqual(flag(args, "device"), "3")
        self.assertEqual(flag(args, "listen"), socket_of(3))
        self.assertEqual(flag(args, "backend"), "cuda")
        self.assertEqual(os.path.basename(flag(args, "config")), os.path.basename(TP_CONFIG))
        self.assertIn("%i", self.unit["Unit"]["Description"][-1])
        self.assertIn("multi-user.target", self.unit["Install"]["WantedBy"])

    def test_the_shared_runtime_directory_outlives_an_instance(self):
        self.assertEqual(self.service["RuntimeDirectory"], [os.path.basename(SOCKET_DIR)])
        self.assertEqual(self.service["RuntimeDirectoryPreserve"], ["yes"])

    def test_per_rank_flags_file_is_optional(self):
        self.assertEqual(self.service["EnvironmentFile"], ["-/etc/specstate/specstate-%i.env"])

    def test_the_rest_is_specstated_service(self):
        """Every other [Service] line of the single-GPU unit, with the same value:
        the user, the restarts, the hardening and what it leaves out."""
        own = {"ExecStart", "RuntimeDirectoryPreserve", "EnvironmentFile", "Environment"}
        for key, values in self.single.items():
            if key in own:
                continue
            self.assertEqual(self.service.get(key), values, key)
        for key in self.service:
            self.assertTrue(key in self.single or key in own, "%s is the template's only" % key)
        for value in self.single.get("Environment", []):
            self.assertIn(value, self.service["Environment"])
        user = self.service["User"][-1]
        entries = [line.split() for line in read(SYSUSERS).splitlines()
                   if line.strip() and not line.startswith("#")]
        self.assertIn(["u", user], [e[:2] for e in entries])

    def test_specstated_takes_the_instances_command_line(self):
        """specstated parses the config and the flags of instance 1's ExecStart
        (on the CPU backend, a socket of its own and a layout small enough for a
        test), serves, and stops on SIGTERM."""
        args = self.exec_start(1)
        directory = tempfile.mkdtemp(prefix="sstp", dir="/tmp")
        address = "unix://%s/specstate-1.sock" % directory
        argv = [SPECSTATED]
        for a in args[1:]:
            if a.startswith("--config="):
                a = "--config=" + TP_CONFIG
            elif a.startswith("--backend="):
                a = "--backend=cpu"
            elif a.startswith("--listen="):
                a = "--listen=" + address
            argv.append(a)
        argv += ["--layers=1", "--blocks=9", "--max_rows=4", "--head_dim=64"]
        log = open(os.path.join(directory, "log"), "w+b")
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(address[len("unix://"):]):
                self.assertIsNone(server.poll(), "specstated exited: %s" % self.log(log))
                self.assertLess(time.monotonic(), deadline, "no socket: %s" % self.log(log))
                time.sleep(0.05)
            self.assertIsNone(server.poll())
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(20)
        self.assertEqual(code, 0, self.log(log))
        log.close()
        os.remove(os.path.join(directory, "log"))
        os.rmdir(directory)

    @staticmethod
    def log(f):
        f.seek(0)
        return f.read().decode(errors="replace")


class TpConfigTest(unittest.TestCase):

    def test_is_a_service_config_of_one_ranks_part(self):
        config = json.loads(read(TP_CONFIG))
        self.assertEqual(ProtoJsonChecker(read(PROTO)).errors(config, "ServiceConfig"), [])
        layout = config["layout"]
        self.assertEqual(layout["backend"], "CUDA")
        # The device and the socket are each rank's flags, never the shared file's.
        self.assertNotIn("device", layout)
        self.assertNotIn("listen", config)
        # Qwen3-Next-80B-A3B at TP=2: 16 key heads, 32 value heads, conv dim 8192.
        self.assertEqual((layout["num_heads"] * 2, layout["num_value_heads"] * 2,
                          layout["conv_dim"] * 2), (16, 32, 8192))


if __name__ == "__main__":
    unittest.main()
