"""Sans-IO wire protocol: frame headers and the connection handshake. Bytes in, events out; no sockets."""
from .framing import (
    FRAME_HEADER_SIZE,
    Frame,
    FrameDecoder,
    Kind,
    Space,
    encode_frame_header,
)
from .handshake import ClientHandshake, HandshakeResult, ServerHandshake

__all__ = [
    "FRAME_HEADER_SIZE",
    "Frame",
    "FrameDecoder",
    "Kind",
    "Space",
    "encode_frame_header",
    "ClientHandshake",
    "HandshakeResult",
    "ServerHandshake",
]
