"""The generated protobuf messages (`pb`) and gRPC stubs (`rpc`) of outbox.v1, for the
calls the client does not wrap, such as the Admin service::

    from outbox_gateway.proto import pb, rpc

    admin = rpc.AdminStub(grpc.insecure_channel("127.0.0.1:50051"))
    admin.GetStats(pb.GetStatsRequest(subscription="billing"))
"""

from ._proto.outbox.v1 import outbox_pb2 as pb
from ._proto.outbox.v1 import outbox_pb2_grpc as rpc

__all__ = ["pb", "rpc"]
