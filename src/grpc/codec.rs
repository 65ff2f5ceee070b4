//! The service's codec: prost's, except that a request which is not valid
//! protobuf (truncated, invalid UTF-8 in a string, nested past prost's limit)
//! is INVALID_ARGUMENT, with prost's message naming the field, rather than
//! INTERNAL: the fault is the caller's, and INTERNAL is for the server's bugs.
//! Like every refusal of the service's, it carries ErrorInfo and a
//! FieldViolation (the field `request`).

use tonic::codec::{BufferSettings, Codec as TonicCodec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;

use crate::error::Error;

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

pub struct CodecDecoder<D>(D);

impl<D: Decoder<Error = Status>> Decoder for CodecDecoder<D> {
    type Item = D::Item;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
        self.0.decode(buf).map_err(|status| match status.code() {
            Code::Internal => super::status::to_status(Error::InvalidArgument {
                field: "request".into(),
                reason: format!("the message is not valid protobuf: {}", status.message()).into(),
            }),
            _ => status,
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
