#!/usr/bin/env python3
"""Writes docs/api.md, the API reference, from the comments in proto/.

Needs grpcio-tools (examples/python/requirements.txt): its bundled protoc compiles the
.proto files into a descriptor set with source info, which carries every comment.

    python3 scripts/gen-api-docs.py          # writes docs/api.md
    python3 scripts/gen-api-docs.py -        # prints it instead
"""

import importlib.resources
import sys
import tempfile
from pathlib import Path

try:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc
except ImportError:
    sys.exit("needs grpcio-tools: pip install -r examples/python/requirements.txt")

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUTPUT = ROOT / "docs" / "api.md"

# Field numbers of the descriptor messages, as used in SourceCodeInfo.Location.path.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE, FILE_SYNTAX = 4, 5, 6, 12
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2

Field = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    number: name.removeprefix("TYPE_").lower()
    for name, number in Field.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def compile_protos():
    """The descriptor set of every file under proto/, with comments."""
    files = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        status = protoc.main(
            [
                "protoc",
                f"-I{PROTO}",
                f"-I{well_known}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *files,
            ]
        )
        if status != 0:
            sys.exit(f"protoc failed with status {status}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def comments(file):
    """Comment text by source path, leading and trailing comments joined."""
    found = {}
    for location in file.source_code_info.location:
        parts = [location.leading_comments, location.trailing_comments]
        lines = "\n".join(p.strip("\n") for p in parts if p.strip()).split("\n")
        text = "\n".join(line.removeprefix(" ").rstrip() for line in lines).strip()
        if text:
            found[tuple(location.path)] = text
    return found


def cell(text):
    """Text for one table cell: paragraphs on one line, pipes escaped."""
    paragraphs = [" ".join(p.split("\n")) for p in text.split("\n\n")]
    return "<br><br>".join(paragraphs).replace("|", "\\|")


def anchor(name):
    return "#" + name.lower().replace(".", "")


class Renderer:
    def __init__(self, file):
        self.file = file
        self.comments = comments(file)
        self.package = file.package
        self.lines = []
        # Map-entry messages, by full name, for rendering map<K, V>.
        self.maps = {}
        for message, _, name in self.messages():
            if message.options.map_entry:
                self.maps["." + self.package + "." + name] = message

    def out(self, *lines):
        self.lines.extend(lines)

    def text(self, path):
        comment = self.comments.get(tuple(path))
        if comment:
            self.out(comment, "")

    def messages(self):
        """Every message (nested ones too) with its source path and name."""

        def walk(message, path, name):
            yield message, path, name
            for i, nested in enumerate(message.nested_type):
                yield from walk(nested, path + [MESSAGE_NESTED, i], f"{name}.{nested.name}")

        for i, message in enumerate(self.file.message_type):
            yield from walk(message, [FILE_MESSAGE, i], message.name)

    def enums(self):
        for i, enum in enumerate(self.file.enum_type):
            yield enum, [FILE_ENUM, i], enum.name
        for message, path, name in self.messages():
            for i, enum in enumerate(message.enum_type):
                yield enum, path + [MESSAGE_ENUM, i], f"{name}.{enum.name}"

    def type_ref(self, type_name):
        """A link to a type of this file, or the full name of another one."""
        prefix = "." + self.package + "."
        if type_name.startswith(prefix):
            name = type_name.removeprefix(prefix)
            return f"[`{name}`]({anchor(name)})"
        return f"`{type_name.removeprefix('.')}`"

    def field_type(self, field):
        if field.type_name in self.maps:
            key, value = self.maps[field.type_name].field
            if value.type in SCALARS:
                return f"`map<{SCALARS[key.type]}, {SCALARS[value.type]}>`"
            return f"map&lt;`{SCALARS[key.type]}`, {self.type_ref(value.type_name)}&gt;"
        base = SCALARS.get(field.type) and f"`{SCALARS[field.type]}`"
        base = base or self.type_ref(field.type_name)
        if field.label == Field.LABEL_REPEATED:
            return "repeated " + base
        if field.proto3_optional:
            return "optional " + base
        return base

    def render(self):
        self.out(f"## `{self.file.name}`", "", f"Package `{self.package}`.", "")
        self.text([FILE_SYNTAX])
        self.services()
        self.message_types()
        self.enum_types()
        return self.lines

    def services(self):
        self.out("### Services", "")
        for i, service in enumerate(self.file.service):
            path = [FILE_SERVICE, i]
            self.out(f"#### {service.name}", "")
            self.text(path)
            for j, method in enumerate(service.method):
                name = f"{service.name}.{method.name}"
                request = self.type_ref(method.input_type)
                response = self.type_ref(method.output_type)
                if method.client_streaming:
                    request = "stream of " + request
                if method.server_streaming:
                    response = "stream of " + response
                self.out(f"##### {name}", "", f"{request} → {response}", "")
                self.text(path + [SERVICE_METHOD, j])

    def message_types(self):
        self.out("### Messages", "")
        for message, path, name in self.messages():
            if message.options.map_entry:
                continue
            self.out(f"#### {name}", "")
            self.text(path)
            if not message.field:
                self.out("No fields.", "")
                continue
            self.out("| Field | Type | Description |", "| --- | --- | --- |")
            for j, field in enumerate(message.field):
                description = cell(self.comments.get(tuple(path + [MESSAGE_FIELD, j]), ""))
                if field.HasField("oneof_index") and not field.proto3_optional:
                    oneof = message.oneof_decl[field.oneof_index].name
                    description = f"One of `{oneof}`. {description}".strip()
                self.out(f"| `{field.name}` | {self.field_type(field)} | {description} |")
            self.out("")

    def enum_types(self):
        self.out("### Enums", "")
        for enum, path, name in self.enums():
            self.out(f"#### {name}", "")
            self.text(path)
            self.out("| Value | Number | Description |", "| --- | --- | --- |")
            for j, value in enumerate(enum.value):
                description = cell(self.comments.get(tuple(path + [ENUM_VALUE, j]), ""))
                self.out(f"| `{value.name}` | {value.number} | {description} |")
            self.out("")


def main():
    descriptors = compile_protos()
    lines = [
        "# API reference",
        "",
        "Generated from the comments in `proto/` by `scripts/gen-api-docs.py`; do not edit it.",
        "",
    ]
    for file in descriptors.file:
        lines += Renderer(file).render()
    document = "\n".join(lines).rstrip() + "\n"
    target = sys.argv[1] if len(sys.argv) > 1 else OUTPUT
    if target == "-":
        sys.stdout.write(document)
    else:
        Path(target).write_text(document)


if __name__ == "__main__":
    main()
