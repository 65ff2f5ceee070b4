//! The service's answer to a request that is not valid protobuf (truncated,
//! invalid UTF-8 in a string, nested past prost's limit). The generated
//! server's codec (idempotency-proto's `codec`) turns prost's INTERNAL into
//! INVALID_ARGUMENT, with prost's message naming the field: the fault is the
//! caller's, and INTERNAL is for the server's bugs. The status comes from the
//! hook installed here, so that, like every refusal of the service's, it is
//! built by `status::to_status` and carries ErrorInfo and a FieldViolation
//! (the field `request`).

use idempotency_proto::codec::{self, install_decode_error};
use tonic::Status;

use crate::error::Error;

/// Installs the service's status for undecodable requests in this process's
/// codec. Idempotent: the service's hook is the only one, so a later call
/// (another server in the same process, as tests start) finds it installed.
pub fn install() {
    let _ = install_decode_error(decode_error);
}

/// The status for a request that is not valid protobuf, from the codec's
/// reason.
fn decode_error(reason: String) -> Status {
    super::status::to_status(Error::InvalidArgument {
        field: codec::FIELD.into(),
        reason: reason.into(),
    })
}

#[cfg(test)]
mod tests {
    use tonic::Code;
    use tonic_types::StatusExt;

    use super::*;

    #[test]
    fn an_undecodable_request_is_refused_like_any_invalid_field() {
        let status = decode_error("the message is not valid protobuf: truncated".into());
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "request: the message is not valid protobuf: truncated"
        );
        let details = status.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "INVALID_ARGUMENT");
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations[0].field, "request");
    }
}
