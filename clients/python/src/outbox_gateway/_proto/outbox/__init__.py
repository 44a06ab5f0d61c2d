"""Generated from proto/outbox/v1/outbox.proto by generate.py; do not edit."""
