"""A stand-in for grpcurl, to run docs/protocol.md's examples where grpcurl is
not installed (Debian 12 does not package it). It takes the part of grpcurl's
command line those examples use and works as grpcurl does: it learns every
method and message from the server's reflection service (no .proto files),
parses each JSON request into the method's request message, and prints each
reply in proto3's JSON mapping.

    grpcurl [-plaintext] [-unix] [-d BODY | -d @] ADDRESS list [SERVICE]
    grpcurl ... ADDRESS describe SYMBOL
    grpcurl ... ADDRESS SERVICE/METHOD

Its command line is read as grpcurl's is (Go's `flag` package): the flags
come first, `-plaintext` and `-unix` are booleans (`-unix` says that ADDRESS
is a Unix socket's path: `grpcurl -plaintext -unix /tmp/x.sock list`), and a
flag after ADDRESS, or `-unix=/tmp/x.sock`, is refused as grpcurl refuses it.

`-d @` reads the requests from standard input as they come (a stream of JSON
objects), and replies print as they arrive, so a bidirectional stream stays
open while its input does. Errors print like grpcurl's ("ERROR:", then the
code and message) and exit with status 1. What it does not copy: grpcurl's
exit codes, its `describe` layout (this one prints each element with its
leading comment in .proto syntax, and a field's trailing comment on its
line) and flags the docs do not use.

The reflection messages' own classes come from the descriptor set named by
$SPECSTATE_DESCRIPTOR_SET (//proto:served_descriptor_set.binpb), as grpcurl
has them compiled in.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

_REFLECTION = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


class Failure(Exception):
    """An error to print as grpcurl does, then exit 1."""


def _message_class(pool: descriptor_pool.DescriptorPool, name: str) -> Any:
    desc = pool.FindMessageTypeByName(name)
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


class Reflection:
    """The server's files, fetched through grpc.reflection.v1 as needed."""

    def __init__(self, channel: grpc.Channel) -> None:
        path = os.environ.get("SPECSTATE_DESCRIPTOR_SET", "")
        try:
            with open(path, "rb") as f:
                bootstrap = descriptor_pb2.FileDescriptorSet.FromString(f.read())
        except OSError as e:
            raise Failure(f"cannot read $SPECSTATE_DESCRIPTOR_SET ({path!r}): {e}") from None
        own = descriptor_pool.DescriptorPool()
        for f in bootstrap.file:
            if f.package == "grpc.reflection.v1":
                own.Add(f)
        self._request = _message_class(own, "grpc.reflection.v1.ServerReflectionRequest")
        response = _message_class(own, "grpc.reflection.v1.ServerReflectionResponse")
        self._call = channel.stream_stream(_REFLECTION,
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=response.FromString)
        self.pool = descriptor_pool.DescriptorPool()
        self.files: Dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def _ask(self, **fields: Any) -> Any:
        try:
            answers = list(self._call(iter([self._request(**fields)]), timeout=20))
        except grpc.RpcError as e:
            raise Failure(_status_text(e.code(), e.details())) from None
        if len(answers) != 1:
            raise Failure(f"reflection answered {len(answers)} messages to one request")
        answer = answers[0]
        if answer.HasField("error_response"):
            err = answer.error_response
            raise Failure(f"Failed to resolve {fields}: reflection answered code "
                          f"{err.error_code}: {err.error_message}")
        return answer

    def services(self) -> List[str]:
        answer = self._ask(list_services="")
        return sorted(s.name for s in answer.list_services_response.service)

    def file_of(self, symbol: str) -> descriptor_pb2.FileDescriptorProto:
        """The file defining `symbol`, added to `pool` with its imports."""
        answer = self._ask(file_containing_symbol=symbol)
        protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
                  for b in answer.file_descriptor_response.file_descriptor_proto]
        for proto in reversed(protos):  # imports first
            if proto.name not in self.files:
                self.pool.Add(proto)
                self.files[proto.name] = proto
        return protos[0]


# ---------------------------------------------------------------------------
# describe: the element and its children, each with its leading comment.

_TYPES = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}


def _comments(file: descriptor_pb2.FileDescriptorProto) -> Dict[Tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments
            for loc in file.source_code_info.location if loc.leading_comments}


def _trailing_comments(file: descriptor_pb2.FileDescriptorProto) -> Dict[Tuple[int, ...], str]:
    return {tuple(loc.path): loc.trailing_comments
            for loc in file.source_code_info.location if loc.trailing_comments.strip()}


def _print_comment(text: str, indent: str, out: List[str]) -> None:
    for line in text.rstrip("\n").split("\n"):
        out.append(f"{indent}//{line}")


def _field_line(field: descriptor_pb2.FieldDescriptorProto) -> str:
    kind = field.type_name.lstrip(".") if field.type_name else _TYPES[field.type]
    label = ""
    if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        label = "repeated "
    elif field.proto3_optional:
        label = "optional "
    return f"{label}{kind} {field.name} = {field.number};"


def _describe_message(msg: descriptor_pb2.DescriptorProto, path: Tuple[int, ...],
                      comments: Dict[Tuple[int, ...], str], trailing: Dict[Tuple[int, ...], str],
                      indent: str, out: List[str]) -> None:
    if path in comments:
        _print_comment(comments[path], indent, out)
    out.append(f"{indent}message {msg.name} {{")
    for i, field in enumerate(msg.field):
        if path + (2, i) in comments:
            _print_comment(comments[path + (2, i)], indent + "  ", out)
        line = f"{indent}  {_field_line(field)}"
        if path + (2, i) in trailing:  # on the field's line, as the .proto has it
            line += " //" + " ".join(trailing[path + (2, i)].split("\n")).rstrip()
        out.append(line)
    out.append(f"{indent}}}")


def _find(file: descriptor_pb2.FileDescriptorProto, symbol: str) -> Optional[Tuple[str, Any, Tuple[int, ...]]]:
    prefix = f"{file.package}." if file.package else ""

    def messages(msgs: Any, scope: str, path: Tuple[int, ...],
                 field_number: int) -> Optional[Tuple[str, Any, Tuple[int, ...]]]:
        for i, m in enumerate(msgs):
            name = scope + m.name
            if name == symbol:
                return "message", m, path + (field_number, i)
            found = messages(m.nested_type, name + ".", path + (field_number, i), 3)
            if found:
                return found
        return None

    for i, s in enumerate(file.service):
        if prefix + s.name == symbol:
            return "service", s, (6, i)
    return messages(file.message_type, prefix, (), 4)


def describe(reflection: Reflection, symbol: str) -> str:
    file = reflection.file_of(symbol)
    found = _find(file, symbol)
    if found is None:
        raise Failure(f"describe: {symbol} is not a message or service (this stand-in "
                      "describes those only)")
    kind, element, path = found
    comments = _comments(file)
    out = [f"{symbol} is a {kind}:"]
    if kind == "message":
        _describe_message(element, path, comments, _trailing_comments(file), "", out)
    else:
        if path in comments:
            _print_comment(comments[path], "", out)
        out.append(f"service {element.name} {{")
        for i, m in enumerate(element.method):
            if path + (2, i) in comments:
                _print_comment(comments[path + (2, i)], "  ", out)
            arg = ("stream " if m.client_streaming else "") + m.input_type
            ret = ("stream " if m.server_streaming else "") + m.output_type
            out.append(f"  rpc {m.name} ( {arg} ) returns ( {ret} );")
        out.append("}")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Invoking a method.

def _status_text(code: grpc.StatusCode, details: Optional[str]) -> str:
    name = "".join(w.capitalize() for w in code.name.split("_"))
    return f"ERROR:\n  Code: {name}\n  Message: {details or ''}"


def _json_objects(text: str) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    text = text.lstrip()
    while text:
        obj, end = decoder.raw_decode(text)
        yield obj
        text = text[end:].lstrip()


def _stdin_objects() -> Iterator[Any]:
    """JSON objects from standard input, each as soon as it is complete."""
    decoder = json.JSONDecoder()
    buf = ""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        buf += chunk.decode()
        while True:
            buf = buf.lstrip()
            if not buf:
                break
            try:
                obj, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                break  # incomplete: wait for more input
            buf = buf[end:]
            yield obj
    if buf.strip():
        raise Failure(f"error getting request data: the input ends inside a message: {buf!r}")


def invoke(channel: grpc.Channel, reflection: Reflection, target: str, data: Optional[str]) -> None:
    if "/" in target:
        service, method = target.split("/", 1)
    else:
        service, _, method = target.rpartition(".")
    file = reflection.file_of(service)
    methods = [m for s in file.service if f"{file.package}.{s.name}" == service
               for m in s.method if m.name == method]
    if not methods:
        raise Failure(f"service {service!r} has no method {method!r}")
    m = methods[0]
    request_class = _message_class(reflection.pool, m.input_type.lstrip("."))
    response_class = _message_class(reflection.pool, m.output_type.lstrip("."))
    full_name = m.input_type.lstrip(".")

    def parse(obj: Any) -> Any:
        msg = request_class()
        try:
            json_format.ParseDict(obj, msg)
        except json_format.ParseError as e:
            # Raised inside gRPC's request thread too: report and leave at once.
            print(f"Error invoking method {target!r}: error getting request data "
                  f"({full_name}): {e}", file=sys.stderr, flush=True)
            os._exit(1)
        return msg

    if data == "@":
        requests: Iterator[Any] = (parse(o) for o in _stdin_objects())
    else:
        try:
            objects = list(_json_objects(data if data is not None else "{}"))
        except json.JSONDecodeError as e:
            raise Failure(f"error getting request data: not JSON: {e}") from None
        requests = iter([parse(o) for o in objects])

    path = f"/{service}/{method}"
    ser = lambda msg: msg.SerializeToString()  # noqa: E731
    try:
        if m.client_streaming and m.server_streaming:
            call = channel.stream_stream(path, request_serializer=ser,
                                         response_deserializer=response_class.FromString)
            replies: Iterator[Any] = call(requests)
        elif m.server_streaming:
            call = channel.unary_stream(path, request_serializer=ser,
                                        response_deserializer=response_class.FromString)
            replies = call(_one(requests, target))
        elif m.client_streaming:
            call = channel.stream_unary(path, request_serializer=ser,
                                        response_deserializer=response_class.FromString)
            replies = iter([call(requests)])
        else:
            call = channel.unary_unary(path, request_serializer=ser,
                                       response_deserializer=response_class.FromString)
            replies = iter([call(_one(requests, target))])
        for reply in replies:
            print(json_format.MessageToJson(reply, indent=2), flush=True)
    except grpc.RpcError as e:
        raise Failure(_status_text(e.code(), e.details())) from None


def _one(requests: Iterator[Any], target: str) -> Any:
    items = list(requests)
    if len(items) != 1:
        raise Failure(f"{target} takes one request; the input holds {len(items)}")
    return items[0]


class Usage(Exception):
    """A command line grpcurl would refuse: print it and exit 2, as grpcurl does."""


# The flags the docs use, as grpcurl declares them with Go's `flag` package:
# booleans take no separate value (`-unix` says that the address, the first
# argument after the flags, is a Unix socket's path), `-d` takes one.
_BOOL_FLAGS = ("plaintext", "unix")
_VALUE_FLAGS = ("d",)
_GO_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
             "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}


def parse_command_line(argv: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    """grpcurl's flags and its positional arguments, parsed as Go's `flag`
    package parses them: flags (`-name`, `--name`, `-name=value`) only before
    the first argument that is not one (or `--`), a boolean flag's value only
    after `=`, every later argument positional. Then what grpcurl does with
    the positionals: ADDRESS, then `list [SERVICE]`, `describe [SYMBOL]` or a
    METHOD; more is "Too many arguments". Raises Usage as grpcurl would fail."""
    flags: Dict[str, Any] = {name: False for name in _BOOL_FLAGS}
    flags["d"] = None
    args = list(argv)
    while args:
        a = args[0]
        if len(a) < 2 or not a.startswith("-"):
            break
        args.pop(0)
        if a == "--":
            break
        name = a[2:] if a.startswith("--") else a[1:]
        if not name or name.startswith("-") or name.startswith("="):
            raise Usage(f"bad flag syntax: {a}")
        value: Optional[str] = None
        if "=" in name:
            name, value = name.split("=", 1)
        if name in _BOOL_FLAGS:
            if value is None:
                flags[name] = True
            elif value in _GO_BOOLS:
                flags[name] = _GO_BOOLS[value]
            else:
                raise Usage(f'invalid boolean value "{value}" for -{name}: parse error')
        elif name in _VALUE_FLAGS:
            if value is None:
                if not args:
                    raise Usage(f"flag needs an argument: -{name}")
                value = args.pop(0)
            flags[name] = value
        else:
            raise Usage(f"flag provided but not defined: -{name} (or one this stand-in "
                        "does not take)")
    positional = args
    if not positional:
        raise Usage("Too few arguments.")
    verb = positional[1] if len(positional) > 1 else None
    most = 3 if verb in ("list", "describe") else 2
    if len(positional) > most:
        raise Usage("Too many arguments.")
    if verb is None:
        raise Usage("Too few arguments.")
    if verb == "describe" and len(positional) < 3:
        raise Usage("describe needs a symbol (this stand-in does not list them all)")
    return flags, positional


def main(argv: List[str]) -> int:
    try:
        flags, positional = parse_command_line(argv)
    except Usage as e:
        print(f"{e}\n{__doc__}", file=sys.stderr)
        return 2
    if not flags["plaintext"]:
        # grpcurl would speak TLS, which specstated does not serve: it fails.
        print("Failed to dial target host: without -plaintext grpcurl uses TLS, and "
              "specstated serves plaintext only (this stand-in speaks plaintext only)",
              file=sys.stderr)
        return 1
    data: Optional[str] = flags["d"]
    address = ("unix://" + os.path.abspath(positional[0])) if flags["unix"] else positional[0]
    with grpc.insecure_channel(address) as channel:
        try:
            reflection = Reflection(channel)
            verb = positional[1]
            if verb == "list" and len(positional) == 2:
                print("\n".join(reflection.services()))
            elif verb == "list":
                file = reflection.file_of(positional[2])
                for s in file.service:
                    if f"{file.package}.{s.name}" == positional[2]:
                        print("\n".join(sorted(f"{positional[2]}.{m.name}" for m in s.method)))
            elif verb == "describe":
                print(describe(reflection, positional[2]))
            else:
                invoke(channel, reflection, verb, data)
        except Failure as e:
            print(e, file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
