"""Every message that crosses an actor channel, and every log record, as msgspec Structs."""

from .codec import ProtocolError, messages, records
from .messages import (SCHEMA_VERSION, ActorMessage, Admit, Cancelled, Drafted, Drain, Failed, Prefilled, RoundAck,
                       TokenEvent, Usage, VerdictQueued, Verified)
from .params import GenerationParams
from .records import FinishRecord, LogRecord, ModelIdentity, RequestRecord, RoundRecord

__all__ = [
    "SCHEMA_VERSION", "ActorMessage", "Admit", "Cancelled", "Drafted", "Drain", "Failed", "FinishRecord", "GenerationParams",
    "LogRecord", "ModelIdentity", "Prefilled", "ProtocolError", "RequestRecord", "RoundAck", "RoundRecord",
    "TokenEvent", "Usage", "VerdictQueued", "Verified", "messages", "records",
]
