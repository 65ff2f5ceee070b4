package idempotency

// Stable event keys and payload fingerprints, byte-compatible with the Python
// and TypeScript clients: the canonical forms are specified in clients/KEYS.md,
// and clients/testdata/key_vectors.json pins every client to the same bytes.

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"reflect"
	"sort"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// keyPrefix is the domain separation and version of the key scheme.
const keyPrefix = "idempotency-key/v1\n"

// DeriveKey returns a stable key from the fields that make an event that
// event (positional: the order matters): 64 lowercase hex characters, the
// SHA-256 of KeyEncoding (clients/KEYS.md).
//
//	key, err := idempotency.DeriveKey("stripe", event.ID)
//
// A field is a string (valid UTF-8), []byte, any Go integer type, or a
// *big.Int / big.Int; the type is part of the key ("1", []byte("1") and 1
// differ). Never include what changes between deliveries (timestamps,
// attempt numbers).
func DeriveKey(fields ...any) (string, error) {
	enc, err := KeyEncoding(fields...)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(enc)
	return hex.EncodeToString(sum[:]), nil
}

// DeriveKeyNamed is DeriveKey for named fields: the names are sorted (by
// their UTF-8 bytes), so the order they are built in does not matter.
//
//	key, err := idempotency.DeriveKeyNamed(map[string]any{"source": "stripe", "event_id": event.ID})
func DeriveKeyNamed(fields map[string]any) (string, error) {
	enc, err := KeyEncodingNamed(fields)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(enc)
	return hex.EncodeToString(sum[:]), nil
}

// MustDeriveKey is DeriveKey that panics on a field it cannot encode (for
// fields whose types are fixed in the code).
func MustDeriveKey(fields ...any) string {
	key, err := DeriveKey(fields...)
	if err != nil {
		panic(err)
	}
	return key
}

// KeyEncoding is the canonical bytes that DeriveKey hashes.
func KeyEncoding(fields ...any) ([]byte, error) {
	if len(fields) == 0 {
		return nil, fmt.Errorf("idempotency.DeriveKey: at least one field is needed")
	}
	buf := bytes.NewBufferString(keyPrefix)
	buf.WriteByte('L')
	writeU64(buf, uint64(len(fields)))
	for i, field := range fields {
		if err := encodeField(buf, field); err != nil {
			return nil, fmt.Errorf("idempotency.DeriveKey: field %d: %w", i, err)
		}
	}
	return buf.Bytes(), nil
}

// KeyEncodingNamed is the canonical bytes that DeriveKeyNamed hashes.
func KeyEncodingNamed(fields map[string]any) ([]byte, error) {
	if len(fields) == 0 {
		return nil, fmt.Errorf("idempotency.DeriveKeyNamed: at least one field is needed")
	}
	names := make([]string, 0, len(fields))
	for name := range fields {
		if !utf8.ValidString(name) {
			return nil, fmt.Errorf("idempotency.DeriveKeyNamed: the field name %q is not valid UTF-8", name)
		}
		names = append(names, name)
	}
	sort.Strings(names) // Go compares strings by their bytes: the UTF-8 byte order
	buf := bytes.NewBufferString(keyPrefix)
	buf.WriteByte('M')
	writeU64(buf, uint64(len(names)))
	for _, name := range names {
		_ = encodeField(buf, name)
		if err := encodeField(buf, fields[name]); err != nil {
			return nil, fmt.Errorf("idempotency.DeriveKeyNamed: field %q: %w", name, err)
		}
	}
	return buf.Bytes(), nil
}

func writeU64(buf *bytes.Buffer, n uint64) {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], n)
	buf.Write(b[:])
}

func writeField(buf *bytes.Buffer, tag byte, body []byte) {
	buf.WriteByte(tag)
	writeU64(buf, uint64(len(body)))
	buf.Write(body)
}

func encodeField(buf *bytes.Buffer, field any) error {
	switch v := field.(type) {
	case string:
		if !utf8.ValidString(v) {
			return fmt.Errorf("a string that is not valid UTF-8 has no canonical form")
		}
		writeField(buf, 's', []byte(v))
		return nil
	case []byte:
		writeField(buf, 'b', v)
		return nil
	case *big.Int:
		if v == nil {
			return fmt.Errorf("a nil *big.Int is not a field")
		}
		writeField(buf, 'i', []byte(v.String()))
		return nil
	case big.Int:
		writeField(buf, 'i', []byte(v.String()))
		return nil
	}
	rv := reflect.ValueOf(field)
	switch rv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		writeField(buf, 'i', []byte(strconv.FormatInt(rv.Int(), 10)))
		return nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		writeField(buf, 'i', []byte(strconv.FormatUint(rv.Uint(), 10)))
		return nil
	case reflect.String:
		return encodeField(buf, rv.String())
	case reflect.Slice:
		if rv.Type().Elem().Kind() == reflect.Uint8 {
			writeField(buf, 'b', rv.Bytes())
			return nil
		}
	}
	if field == nil {
		return fmt.Errorf("a field must be a string, bytes or an integer, got nil")
	}
	return fmt.Errorf("a field must be a string, bytes or an integer, got %T", field)
}

// Fingerprint is the SHA-256 (32 bytes) of a payload, for Claim's
// fingerprint (clients/KEYS.md):
//
//   - []byte: the bytes as they are (hash a webhook's raw body this way);
//   - a string: its UTF-8 bytes (never JSON-encoded first);
//   - json.RawMessage: the JSON text, parsed and written as canonical JSON;
//   - anything else (maps, slices, structs, numbers, bool, nil): its
//     canonical JSON (see CanonicalJSON).
func Fingerprint(payload any) ([]byte, error) {
	var data []byte
	switch v := payload.(type) {
	case []byte:
		data = v
	case string:
		if !utf8.ValidString(v) {
			return nil, fmt.Errorf("idempotency.Fingerprint: a string that is not valid UTF-8 has no canonical form")
		}
		data = []byte(v)
	default:
		var err error
		if data, err = CanonicalJSON(payload); err != nil {
			return nil, err
		}
	}
	sum := sha256.Sum256(data)
	return sum[:], nil
}

// MustFingerprint is Fingerprint that panics on a payload it cannot encode.
func MustFingerprint(payload any) []byte {
	fp, err := Fingerprint(payload)
	if err != nil {
		panic(err)
	}
	return fp
}

// maxSafe is 2^53 - 1, the largest integer every language reads exactly.
const maxSafe = 1<<53 - 1

// CanonicalJSON is the canonical JSON of a value (UTF-8), as Fingerprint
// hashes it: RFC 8785 restricted to integers (clients/KEYS.md). No
// whitespace; object members sorted by their names' UTF-16 code units;
// numbers must be integers within ±(2^53 − 1) (1.0 is written 1; 1.5 is an
// error). A json.RawMessage is parsed first; a value of another type (a
// struct) goes through encoding/json first, so its json tags apply.
func CanonicalJSON(value any) ([]byte, error) {
	var buf bytes.Buffer
	if err := writeCanonical(&buf, value); err != nil {
		return nil, fmt.Errorf("idempotency.CanonicalJSON: %w", err)
	}
	return buf.Bytes(), nil
}

func writeCanonical(buf *bytes.Buffer, value any) error {
	switch v := value.(type) {
	case nil:
		buf.WriteString("null")
		return nil
	case bool:
		if v {
			buf.WriteString("true")
		} else {
			buf.WriteString("false")
		}
		return nil
	case string:
		return writeString(buf, v)
	case json.Number:
		return writeNumberText(buf, string(v))
	case float64:
		return writeFloat(buf, v)
	case float32:
		return writeFloat(buf, float64(v))
	case *big.Int:
		if v == nil {
			buf.WriteString("null")
			return nil
		}
		return writeBigInt(buf, v)
	case json.RawMessage:
		tree, err := parseJSON(v)
		if err != nil {
			return err
		}
		return writeCanonical(buf, tree)
	case map[string]any:
		return writeObject(buf, v)
	case []any:
		buf.WriteByte('[')
		for i, item := range v {
			if i > 0 {
				buf.WriteByte(',')
			}
			if err := writeCanonical(buf, item); err != nil {
				return err
			}
		}
		buf.WriteByte(']')
		return nil
	}
	rv := reflect.ValueOf(value)
	switch rv.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return writeBigInt(buf, big.NewInt(rv.Int()))
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return writeBigInt(buf, new(big.Int).SetUint64(rv.Uint()))
	}
	// Anything else (structs, typed maps and slices, json.Marshaler): through
	// encoding/json, then canonicalised.
	text, err := json.Marshal(value)
	if err != nil {
		return err
	}
	tree, err := parseJSON(text)
	if err != nil {
		return err
	}
	return writeCanonical(buf, tree)
}

func parseJSON(text []byte) (any, error) {
	if !utf8.Valid(text) {
		return nil, fmt.Errorf("the JSON text is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber()
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("more than one JSON value")
	}
	return tree, nil
}

func writeObject(buf *bytes.Buffer, object map[string]any) error {
	type member struct {
		name  string
		units []uint16
	}
	members := make([]member, 0, len(object))
	for name := range object {
		if !utf8.ValidString(name) {
			return fmt.Errorf("the member name %q is not valid UTF-8", name)
		}
		members = append(members, member{name, utf16.Encode([]rune(name))})
	}
	// By UTF-16 code units, as RFC 8785 (and JavaScript) order members.
	sort.Slice(members, func(i, j int) bool {
		a, b := members[i].units, members[j].units
		for k := 0; k < len(a) && k < len(b); k++ {
			if a[k] != b[k] {
				return a[k] < b[k]
			}
		}
		return len(a) < len(b)
	})
	buf.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			buf.WriteByte(',')
		}
		_ = writeString(buf, m.name)
		buf.WriteByte(':')
		if err := writeCanonical(buf, object[m.name]); err != nil {
			return err
		}
	}
	buf.WriteByte('}')
	return nil
}

// writeString writes a string as JavaScript's JSON.stringify does.
func writeString(buf *bytes.Buffer, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("a string that is not valid UTF-8 has no canonical form")
	}
	buf.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			buf.WriteString(`\"`)
		case '\\':
			buf.WriteString(`\\`)
		case '\b':
			buf.WriteString(`\b`)
		case '\f':
			buf.WriteString(`\f`)
		case '\n':
			buf.WriteString(`\n`)
		case '\r':
			buf.WriteString(`\r`)
		case '\t':
			buf.WriteString(`\t`)
		default:
			if c < 0x20 {
				fmt.Fprintf(buf, `\u%04x`, c)
			} else {
				buf.WriteByte(c)
			}
		}
	}
	buf.WriteByte('"')
	return nil
}

func writeFloat(buf *bytes.Buffer, f float64) error {
	if math.IsNaN(f) || math.IsInf(f, 0) || f != math.Trunc(f) || math.Abs(f) > maxSafe {
		return fmt.Errorf("%v is not an integer within ±(2^53 - 1); encode it as a string or in minor units", f)
	}
	buf.WriteString(strconv.FormatInt(int64(f), 10)) // -0 is written 0
	return nil
}

func writeNumberText(buf *bytes.Buffer, text string) error {
	r, ok := new(big.Rat).SetString(text)
	if !ok {
		return fmt.Errorf("%q is not a number", text)
	}
	if !r.IsInt() {
		return fmt.Errorf("%s is not an integer within ±(2^53 - 1); encode it as a string or in minor units", text)
	}
	return writeBigInt(buf, r.Num())
}

var maxSafeBig = big.NewInt(maxSafe)

func writeBigInt(buf *bytes.Buffer, n *big.Int) error {
	if new(big.Int).Abs(n).Cmp(maxSafeBig) > 0 {
		return fmt.Errorf("%s is beyond ±(2^53 - 1); encode it as a string", n)
	}
	buf.WriteString(n.String())
	return nil
}
