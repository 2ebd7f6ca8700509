#!/usr/bin/python3
"""Asks a specstated for its services through gRPC server reflection, as
grpcurl would (`grpcurl -plaintext -unix SOCKET list`), and checks the answer:

  /usr/bin/python3 deploy/container/reflection_check.py unix:///PATH/specstate.sock

Prints the services and the methods of specstate.v1.SpecState; exits 0 when
reflection lists specstate.v1.SpecState and grpc.health.v1.Health and
describes SpecState's file. Needs Debian's python3-grpcio and python3-protobuf
only: the reflection messages are encoded and decoded by hand.
"""
import sys

import grpc
from google.protobuf import descriptor_pb2

METHODS = ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")


def varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def string_field(number, text):
    data = text.encode()
    return varint(number << 3 | 2) + varint(len(data)) + data


def fields(data):
    """[(number, value)] of a message: ints for varints, bytes for the rest."""
    result, i = [], 0
    while i < len(data):
        key = shift = 0
        while True:
            byte = data[i]; i += 1
            key |= (byte & 0x7F) << shift; shift += 7
            if byte < 0x80:
                break
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = shift = 0
            while True:
                byte = data[i]; i += 1
                value |= (byte & 0x7F) << shift; shift += 7
                if byte < 0x80:
                    break
        elif wire == 2:
            length = shift = 0
            while True:
                byte = data[i]; i += 1
                length |= (byte & 0x7F) << shift; shift += 7
                if byte < 0x80:
                    break
            value, i = data[i:i + length], i + length
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % wire)
        result.append((number, value))
    return result


def ask(channel, requests):
    last = None
    for method in METHODS:
        call = channel.stream_stream(method, request_serializer=None,
                                     response_deserializer=None)
        try:
            return method, list(call(iter(requests), timeout=5))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            last = e
    raise last


def main(address):
    channel = grpc.insecure_channel(address)
    method, (listed, described) = ask(channel, [
        string_field(7, ""),                        # list_services
        string_field(4, "specstate.v1.SpecState"),  # file_containing_symbol
    ])
    services = []
    for number, value in fields(listed):
        if number == 6:                             # list_services_response
            services += [fields(s)[0][1].decode() for n, s in fields(value) if n == 1]
        if number == 7:
            sys.exit("reflection error: %r" % fields(value))
    print("reflection (%s): %s" % (method.split("/")[1], " ".join(sorted(services))))
    methods = []
    for number, value in fields(described):
        if number == 4:                             # file_descriptor_response
            for n, blob in fields(value):
                file = descriptor_pb2.FileDescriptorProto.FromString(blob)
                for service in file.service:
                    if "%s.%s" % (file.package, service.name) == "specstate.v1.SpecState":
                        methods = [m.name for m in service.method]
                        print("%s: specstate.v1.SpecState: %d methods: %s" % (
                            file.name, len(methods), " ".join(methods)))
    missing = {"specstate.v1.SpecState", "grpc.health.v1.Health"} - set(services)
    if missing or not methods:
        sys.exit("FAIL: reflection lists no %s" % (" ".join(sorted(missing)) or
                                                     "methods of specstate.v1.SpecState"))
    print("reflection: PASS")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
