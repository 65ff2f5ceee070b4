package idempotency_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math/big"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"idempotencyservice/idempotency"
)

// The vectors every client is pinned to (clients/KEYS.md).
type vectors struct {
	DeriveKey []struct {
		Name        string
		Fields      []map[string]string
		Mapping     map[string]map[string]string
		EncodingHex string `json:"encoding_hex"`
		Key         string
	} `json:"derive_key"`
	Fingerprint []struct {
		Name        string
		Bytes       *string
		Text        *string
		JSON        json.RawMessage `json:"json"`
		JSONText    *string         `json:"json_text"`
		Canonical   *string
		Fingerprint string
	}
	InvalidDeriveKey []struct {
		Name   string
		Fields []any
	} `json:"invalid_derive_key"`
	InvalidFingerprintJSON []struct {
		Name string
		JSON json.RawMessage `json:"json"`
	} `json:"invalid_fingerprint_json"`
}

func loadVectors(t *testing.T) *vectors {
	t.Helper()
	path := os.Getenv("IDEMPOTENCY_KEY_VECTORS")
	if path == "" {
		_, file, _, _ := runtime.Caller(0)
		if resolved, err := filepath.EvalSymlinks(file); err == nil {
			file = resolved
		}
		path = filepath.Join(filepath.Dir(file), "..", "..", "testdata", "key_vectors.json")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("key vectors: %v (set IDEMPOTENCY_KEY_VECTORS)", err)
	}
	var v vectors
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.DeriveKey) == 0 || len(v.Fingerprint) == 0 || len(v.InvalidDeriveKey) == 0 || len(v.InvalidFingerprintJSON) == 0 {
		t.Fatalf("key vectors: a section is empty in %s", path)
	}
	return &v
}

// field turns a vector's {"s": ...} / {"b": hex} / {"i": decimal} into a Go value.
func field(t *testing.T, f map[string]string) any {
	t.Helper()
	if len(f) != 1 {
		t.Fatalf("a field has one tag: %v", f)
	}
	for tag, value := range f {
		switch tag {
		case "s":
			return value
		case "b":
			b, err := hex.DecodeString(value)
			if err != nil {
				t.Fatal(err)
			}
			return b
		case "i":
			n, ok := new(big.Int).SetString(value, 10)
			if !ok {
				t.Fatalf("not an integer: %q", value)
			}
			if n.IsInt64() {
				return n.Int64() // the int64 path
			}
			return n
		}
		t.Fatalf("unknown tag %q", tag)
	}
	return nil
}

func TestDeriveKeyVectors(t *testing.T) {
	v := loadVectors(t)
	for _, vec := range v.DeriveKey {
		t.Run(vec.Name, func(t *testing.T) {
			var enc []byte
			var key string
			var err, err2 error
			if vec.Mapping != nil {
				named := map[string]any{}
				for name, f := range vec.Mapping {
					named[name] = field(t, f)
				}
				enc, err = idempotency.KeyEncodingNamed(named)
				key, err2 = idempotency.DeriveKeyNamed(named)
			} else {
				var fields []any
				for _, f := range vec.Fields {
					fields = append(fields, field(t, f))
				}
				enc, err = idempotency.KeyEncoding(fields...)
				key, err2 = idempotency.DeriveKey(fields...)
			}
			if err != nil || err2 != nil {
				t.Fatalf("%v / %v", err, err2)
			}
			if got := hex.EncodeToString(enc); got != vec.EncodingHex {
				t.Errorf("encoding\n got %s\nwant %s", got, vec.EncodingHex)
			}
			if key != vec.Key {
				t.Errorf("key %s, want %s", key, vec.Key)
			}
		})
	}
}

func TestDeriveKeyAcceptsEveryIntegerType(t *testing.T) {
	want := idempotency.MustDeriveKey(int64(7))
	for _, n := range []any{7, int8(7), int16(7), int32(7), uint(7), uint8(7), uint16(7), uint32(7), uint64(7), big.NewInt(7)} {
		if got := idempotency.MustDeriveKey(n); got != want {
			t.Errorf("%T: %s, want %s", n, got, want)
		}
	}
	if idempotency.MustDeriveKey("7") == want || idempotency.MustDeriveKey([]byte("7")) == want {
		t.Error("the type must be part of the key")
	}
}

func TestInvalidDeriveKeyVectors(t *testing.T) {
	v := loadVectors(t)
	for _, vec := range v.InvalidDeriveKey {
		t.Run(vec.Name, func(t *testing.T) {
			if key, err := idempotency.DeriveKey(vec.Fields...); err == nil {
				t.Errorf("DeriveKey(%v) = %s, want an error", vec.Fields, key)
			}
		})
	}
	if _, err := idempotency.DeriveKeyNamed(map[string]any{}); err == nil {
		t.Error("DeriveKeyNamed with no fields must fail")
	}
	if _, err := idempotency.DeriveKey("\xff"); err == nil {
		t.Error("a string that is not UTF-8 must fail")
	}
}

func TestFingerprintVectors(t *testing.T) {
	v := loadVectors(t)
	for _, vec := range v.Fingerprint {
		t.Run(vec.Name, func(t *testing.T) {
			var payloads []any
			switch {
			case vec.Bytes != nil:
				b, err := hex.DecodeString(*vec.Bytes)
				if err != nil {
					t.Fatal(err)
				}
				payloads = append(payloads, b)
			case vec.Text != nil:
				payloads = append(payloads, *vec.Text)
			case vec.JSONText != nil:
				payloads = append(payloads, json.RawMessage(*vec.JSONText))
			case vec.JSON != nil:
				// As a json.RawMessage, as the tree encoding/json decodes
				// (float64 numbers), and with json.Number.
				payloads = append(payloads, vec.JSON)
				var tree any
				if err := json.Unmarshal(vec.JSON, &tree); err != nil {
					t.Fatal(err)
				}
				payloads = append(payloads, tree)
				dec := json.NewDecoder(bytes.NewReader(vec.JSON))
				dec.UseNumber()
				var numbers any
				if err := dec.Decode(&numbers); err != nil {
					t.Fatal(err)
				}
				payloads = append(payloads, numbers)
			default:
				t.Fatal("a vector without a payload")
			}
			for _, payload := range payloads {
				if vec.Canonical != nil {
					canonical, err := idempotency.CanonicalJSON(payload)
					if err != nil {
						t.Fatalf("%T: %v", payload, err)
					}
					if string(canonical) != *vec.Canonical {
						t.Errorf("%T: canonical\n got %s\nwant %s", payload, canonical, *vec.Canonical)
					}
				}
				fp, err := idempotency.Fingerprint(payload)
				if err != nil {
					t.Fatalf("%T: %v", payload, err)
				}
				if got := hex.EncodeToString(fp); got != vec.Fingerprint {
					t.Errorf("%T: fingerprint %s, want %s", payload, got, vec.Fingerprint)
				}
			}
		})
	}
}

func TestInvalidFingerprintVectors(t *testing.T) {
	v := loadVectors(t)
	for _, vec := range v.InvalidFingerprintJSON {
		t.Run(vec.Name, func(t *testing.T) {
			var tree any
			if err := json.Unmarshal(vec.JSON, &tree); err != nil {
				t.Fatal(err)
			}
			for _, payload := range []any{vec.JSON, tree} {
				if fp, err := idempotency.Fingerprint(payload); err == nil {
					t.Errorf("%T: Fingerprint(%s) = %x, want an error", payload, vec.JSON, fp)
				}
			}
		})
	}
}

func TestCanonicalJSONOfAStructUsesItsJSONTags(t *testing.T) {
	type line struct {
		SKU string `json:"sku"`
		Qty int    `json:"qty"`
	}
	type order struct {
		ID    string `json:"id"`
		Lines []line `json:"lines"`
	}
	got, err := idempotency.CanonicalJSON(map[string]any{"order": order{"ord_1", []line{{"A", 2}}}, "currency": "EUR"})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"currency":"EUR","order":{"id":"ord_1","lines":[{"qty":2,"sku":"A"}]}}`
	if string(got) != want {
		t.Errorf("got %s, want %s", got, want)
	}
}
