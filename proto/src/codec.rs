//! The codec of the generated client and server: prost's, except that a
//! message which is not valid protobuf (truncated, invalid UTF-8 in a string,
//! nested past prost's limit) is INVALID_ARGUMENT, with prost's message naming
//! the field, rather than INTERNAL: the fault is the sender's, and INTERNAL is
//! for the server's bugs.
//!
//! The status itself comes from a hook the server installs once per process
//! ([`install_decode_error`]), so that a server answers with the error details
//! all its other refusals carry (the idempotency service: ErrorInfo and a
//! FieldViolation, built where it builds every status). Without a hook, the
//! answer is a plain INVALID_ARGUMENT naming the field [`FIELD`].

use std::sync::OnceLock;

use tonic::codec::{BufferSettings, Codec as TonicCodec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

/// The field an undecodable message's status names: the whole request.
pub const FIELD: &str = "request";

/// Builds the status for a message that is not valid protobuf, from the reason
/// (`the message is not valid protobuf: ` and prost's message). The status is
/// about the field [`FIELD`].
pub type DecodeErrorStatus = fn(reason: String) -> Status;

static DECODE_ERROR: OnceLock<DecodeErrorStatus> = OnceLock::new();

/// Installs the status every codec of this process answers an undecodable
/// message with. The first installation wins: a later one returns its hook
/// back as the error and changes nothing.
pub fn install_decode_error(hook: DecodeErrorStatus) -> Result<(), DecodeErrorStatus> {
    DECODE_ERROR.set(hook)
}

/// The status for an undecodable message: the installed hook's, or a plain
/// INVALID_ARGUMENT whose message names [`FIELD`].
fn decode_error(reason: String) -> Status {
    match DECODE_ERROR.get() {
        Some(hook) => hook(reason),
        None => Status::invalid_argument(format!("{FIELD}: {reason}")),
    }
}

/// prost's codec, with decode failures mapped by [`install_decode_error`]'s
/// hook. The generated client and server make one per call.
#[derive(Debug, Clone, Default)]
pub struct Codec<T, U>(ProstCodec<T, U>);

impl<T, U> TonicCodec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as TonicCodec>::Encoder;
    type Decoder = CodecDecoder<<ProstCodec<T, U> as TonicCodec>::Decoder>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CodecDecoder(self.0.decoder())
    }
}

/// prost's decoder, whose INTERNAL for bytes that are not valid protobuf
/// becomes the [`install_decode_error`] hook's status.
pub struct CodecDecoder<D>(D);

impl<D: Decoder<Error = Status>> Decoder for CodecDecoder<D> {
    type Item = D::Item;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        self.0.decode(buf).map_err(|status| match status.code() {
            Code::Internal => decode_error(format!(
                "the message is not valid protobuf: {}",
                status.message()
            )),
            _ => status,
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_hook_an_undecodable_message_is_invalid_argument_naming_the_request() {
        let status = decode_error("the message is not valid protobuf: truncated".into());
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "request: the message is not valid protobuf: truncated"
        );
    }
}
