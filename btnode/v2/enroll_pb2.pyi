from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EnrollRequest(_message.Message):
    __slots__ = ("code_id", "csr", "proof")
    CODE_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    code_id: str
    csr: bytes
    proof: bytes
    def __init__(self, code_id: _Optional[str] = ..., csr: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class EnrollReply(_message.Message):
    __slots__ = ("certificate", "ca", "name", "role")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    CA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    certificate: bytes
    ca: bytes
    name: str
    role: str
    def __init__(self, certificate: _Optional[bytes] = ..., ca: _Optional[bytes] = ..., name: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...
