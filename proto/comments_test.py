"""Every element of specstate.proto carries its documentation (issue 25).

specstated serves the .proto's comments through reflection, so that
`grpcurl describe specstate.v1.VerifyRequest` shows what each field is; an
element without a comment shows bare. This test reads the descriptor set the
server embeds (//proto:served_descriptor_set.binpb, built with
--include_source_info) and fails on every message, field, oneof, enum, enum
value, service and method of specstate/v1/specstate.proto that has neither a
leading comment (the lines just above it) nor a trailing one (on its line, or
just below). A detached comment (separated by a blank line) does not count.
The failure lists each element with its line, e.g.
`specstate.proto:412: field specstate.v1.VerifyRequest.session_id`.
Map fields' synthetic entry messages (RpcStats.ErrorsEntry) have no source
and are not checked; the map field itself is.
"""
from __future__ import annotations

import os
import unittest
from typing import Dict, List, Sequence, Tuple

import junit_runner
from google.protobuf import descriptor_pb2

_WORKSPACE = os.environ.get("TEST_WORKSPACE", "specstate")
_FILE = "specstate/v1/specstate.proto"

# Field numbers of the descriptor.proto messages, as SourceCodeInfo paths use them.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM, _MESSAGE_ONEOF = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


def _runfile(relative: str) -> str:
    for root in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
        if root:
            path = os.path.join(root, _WORKSPACE, relative)
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"{relative} is not in this test's runfiles (run it with bazel test)")


def elements(file: descriptor_pb2.FileDescriptorProto) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """(kind, full name, source path) of every element to document, in file order."""
    out: List[Tuple[str, str, Tuple[int, ...]]] = []
    package = f"{file.package}." if file.package else ""

    def enum(e: descriptor_pb2.EnumDescriptorProto, scope: str, path: Tuple[int, ...]) -> None:
        out.append(("enum", scope + e.name, path))
        # Enum values are scoped as siblings of their enum (C++ rules).
        for i, v in enumerate(e.value):
            out.append(("enum value", f"{scope}{e.name}.{v.name}", path + (_ENUM_VALUE, i)))

    def message(m: descriptor_pb2.DescriptorProto, scope: str, path: Tuple[int, ...]) -> None:
        if m.options.map_entry:
            return  # synthesized by protoc for a map field: no source of its own
        name = scope + m.name
        out.append(("message", name, path))
        for i, o in enumerate(m.oneof_decl):
            if any(f.proto3_optional and f.oneof_index == i for f in m.field):
                continue  # the synthetic oneof of a proto3 `optional` field
            out.append(("oneof", f"{name}.{o.name}", path + (_MESSAGE_ONEOF, i)))
        for i, f in enumerate(m.field):
            out.append(("field", f"{name}.{f.name}", path + (_MESSAGE_FIELD, i)))
        for i, e in enumerate(m.enum_type):
            enum(e, name + ".", path + (_MESSAGE_ENUM, i))
        for i, n in enumerate(m.nested_type):
            message(n, name + ".", path + (_MESSAGE_NESTED, i))

    for i, s in enumerate(file.service):
        out.append(("service", package + s.name, (_FILE_SERVICE, i)))
        for j, m in enumerate(s.method):
            out.append(("method", f"{package}{s.name}.{m.name}",
                        (_FILE_SERVICE, i, _SERVICE_METHOD, j)))
    for i, e in enumerate(file.enum_type):
        enum(e, package, (_FILE_ENUM, i))
    for i, m in enumerate(file.message_type):
        message(m, package, (_FILE_MESSAGE, i))
    return out


def uncommented(file: descriptor_pb2.FileDescriptorProto) -> List[str]:
    """Every element of `file` without a leading or trailing comment, as
    "<file>:<line>: <kind> <full name>" (line 1-based; "?" without source)."""
    locations: Dict[Tuple[int, ...], descriptor_pb2.SourceCodeInfo.Location] = {
        tuple(loc.path): loc for loc in file.source_code_info.location}
    missing = []
    for kind, name, path in elements(file):
        loc = locations.get(path)
        if loc is not None and (loc.leading_comments.strip() or loc.trailing_comments.strip()):
            continue
        line = str(loc.span[0] + 1) if loc is not None and loc.span else "?"
        missing.append(f"{os.path.basename(file.name)}:{line}: {kind} {name}")
    return missing


def _location(path: Sequence[int], line: int, leading: str = "", trailing: str = "",
              detached: Sequence[str] = ()) -> descriptor_pb2.SourceCodeInfo.Location:
    loc = descriptor_pb2.SourceCodeInfo.Location(path=list(path), span=[line, 0, 10])
    if leading:
        loc.leading_comments = leading
    if trailing:
        loc.trailing_comments = trailing
    loc.leading_detached_comments.extend(detached)
    return loc


class CheckerTest(unittest.TestCase):
    """The check itself, on a small file made here: it must see what is missing."""

    def _file(self) -> descriptor_pb2.FileDescriptorProto:
        f = descriptor_pb2.FileDescriptorProto(name="x/y.proto", package="p")
        m = f.message_type.add(name="M")
        m.field.add(name="a", number=1)
        m.field.add(name="b", number=2)
        m.oneof_decl.add(name="kind")
        m.field.add(name="c", number=3, oneof_index=0)
        m.nested_type.add(name="N").field.add(name="d", number=1)
        m.nested_type.add(name="EEntry").options.map_entry = True
        e = f.enum_type.add(name="E")
        e.value.add(name="E_ZERO", number=0)
        e.value.add(name="E_ONE", number=1)
        s = f.service.add(name="S")
        s.method.add(name="Call")
        return f

    def test_lists_every_uncommented_element(self) -> None:
        f = self._file()
        f.source_code_info.location.extend([
            _location([4, 0], 10, leading=" M.\n"),
            _location([4, 0, 2, 0], 11, leading=" a.\n"),
            _location([4, 0, 2, 1], 12, trailing=" b.\n"),
            _location([4, 0, 8, 0], 13, detached=[" not the oneof's own.\n"]),
            _location([4, 0, 2, 2], 14, leading="  \n"),  # blank: no comment
            _location([4, 0, 3, 0], 15, leading=" N.\n"),
            _location([5, 0], 20, leading=" E.\n"),
            _location([5, 0, 2, 0], 21, leading=" zero.\n"),
            _location([6, 0], 30, leading=" S.\n"),
        ])
        self.assertEqual(uncommented(f), [
            "y.proto:?: method p.S.Call",
            "y.proto:?: enum value p.E.E_ONE",
            "y.proto:14: oneof p.M.kind",
            "y.proto:15: field p.M.c",
            "y.proto:?: field p.M.N.d",
        ])

    def test_a_fully_commented_file_passes(self) -> None:
        f = self._file()
        for kind, _, path in elements(f):
            f.source_code_info.location.append(_location(path, 1, leading=f" a {kind}.\n"))
        self.assertEqual(uncommented(f), [])
        kinds = sorted({kind for kind, _, _ in elements(f)})
        self.assertEqual(kinds, ["enum", "enum value", "field", "message", "method", "oneof",
                                 "service"])


class SpecStateProtoTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        with open(_runfile("proto/served_descriptor_set.binpb"), "rb") as f:
            files = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
        cls.file = next(f for f in files if f.name == _FILE)

    def test_the_set_has_source_info(self) -> None:
        # Without --include_source_info every element would look uncommented;
        # say so rather than list them all.
        self.assertGreater(len(self.file.source_code_info.location), 100)

    def test_every_element_is_walked(self) -> None:
        # The walk reaches every message, field, enum value and method the file
        # defines (nothing nested is skipped), counted independently here.
        def count(msgs: Sequence[descriptor_pb2.DescriptorProto]) -> Tuple[int, int, int]:
            m = f = v = 0
            for msg in msgs:
                if msg.options.map_entry:
                    continue
                nm, nf, nv = count(msg.nested_type)
                m += 1 + nm
                f += len(msg.field) + nf
                v += sum(len(e.value) for e in msg.enum_type) + nv
            return m, f, v

        messages, fields, values = count(self.file.message_type)
        values += sum(len(e.value) for e in self.file.enum_type)
        methods = sum(len(s.method) for s in self.file.service)
        walked = [kind for kind, _, _ in elements(self.file)]
        self.assertEqual(walked.count("message"), messages)
        self.assertEqual(walked.count("field"), fields)
        self.assertEqual(walked.count("enum value"), values)
        self.assertEqual(walked.count("method"), methods)
        self.assertGreaterEqual(fields, 150)

    def test_every_element_has_a_comment(self) -> None:
        missing = uncommented(self.file)
        self.assertEqual(missing, [], f"{len(missing)} elements of {_FILE} have no comment "
                         "(a leading // comment just above them, or a trailing one on their "
                         "line), so `grpcurl describe` shows them bare:\n" + "\n".join(missing))


if __name__ == "__main__":
    junit_runner.main()
