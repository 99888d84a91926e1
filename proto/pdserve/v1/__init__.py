"""Generated protobuf/gRPC stubs of the ``pdserve.v1`` wire contract.

Do not edit the ``*_pb2*.py(i)`` files by hand: change the ``.proto`` files and run
``proto/generate.sh``. ``tests/test_proto_stubs.py`` fails when the stubs are stale.
"""
