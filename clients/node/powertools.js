// idempotency-client/powertools: the persistence layer for Powertools for AWS
// Lambda's idempotency utility (needs @aws-lambda-powertools/idempotency).
module.exports = require("./dist/src/powertools");
