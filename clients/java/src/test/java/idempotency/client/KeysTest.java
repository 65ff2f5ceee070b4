package idempotency.client;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.gson.JsonPrimitive;
import java.io.IOException;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Checks Keys against every vector of clients/testdata/key_vectors.json (the
 * ones the Python and Node suites check): encodings, keys, canonical JSON,
 * fingerprints, and the inputs every language must refuse.
 */
final class KeysTest {
  private KeysTest() {}

  static void run(Check check, Path vectorsFile) throws IOException {
    JsonObject vectors = JsonParser.parseString(Files.readString(vectorsFile)).getAsJsonObject();
    int count = 0;
    for (JsonElement element : vectors.getAsJsonArray("derive_key")) {
      JsonObject vector = element.getAsJsonObject();
      String name = "derive_key: " + vector.get("name").getAsString();
      byte[] encoding;
      String key;
      if (vector.has("mapping")) {
        Map<String, Object> named = new LinkedHashMap<>();
        for (Map.Entry<String, JsonElement> entry : vector.getAsJsonObject("mapping").entrySet()) {
          named.put(entry.getKey(), typedField(entry.getValue().getAsJsonObject()));
        }
        encoding = Keys.keyEncoding(named);
        key = Keys.deriveKey(named);
      } else {
        List<Object> fields = new ArrayList<>();
        for (JsonElement field : vector.getAsJsonArray("fields")) {
          fields.add(typedField(field.getAsJsonObject()));
        }
        encoding = Keys.keyEncoding(fields.toArray());
        key = Keys.deriveKey(fields.toArray());
      }
      check.equal(name + " (encoding)", vector.get("encoding_hex").getAsString(), Keys.hex(encoding));
      check.equal(name + " (key)", vector.get("key").getAsString(), key);
      count++;
    }
    for (JsonElement element : vectors.getAsJsonArray("fingerprint")) {
      JsonObject vector = element.getAsJsonObject();
      String name = "fingerprint: " + vector.get("name").getAsString();
      Object payload;
      if (vector.has("bytes")) {
        payload = unhex(vector.get("bytes").getAsString());
      } else if (vector.has("text")) {
        payload = vector.get("text").getAsString();
      } else {
        JsonElement json = vector.has("json") ? vector.get("json") : JsonParser.parseString(vector.get("json_text").getAsString());
        payload = toJava(json);
        check.equal(name + " (canonical)", vector.get("canonical").getAsString(),
            new String(Keys.canonicalJson(payload), StandardCharsets.UTF_8));
      }
      check.equal(name, vector.get("fingerprint").getAsString(), Keys.hex(Keys.fingerprint(payload)));
      count++;
    }
    for (JsonElement element : vectors.getAsJsonArray("invalid_derive_key")) {
      JsonObject vector = element.getAsJsonObject();
      List<Object> fields = new ArrayList<>();
      for (JsonElement field : vector.getAsJsonArray("fields")) {
        fields.add(toJava(field));
      }
      check.throwsException("invalid derive_key: " + vector.get("name").getAsString(),
          IllegalArgumentException.class, () -> Keys.deriveKey(fields.toArray()));
      count++;
    }
    for (JsonElement element : vectors.getAsJsonArray("invalid_fingerprint_json")) {
      JsonObject vector = element.getAsJsonObject();
      Object payload = toJava(vector.get("json"));
      check.throwsException("invalid fingerprint: " + vector.get("name").getAsString(),
          IllegalArgumentException.class, () -> Keys.fingerprint(payload));
      count++;
    }
    // Java-specific: types that have no canonical form.
    check.throwsException("derive_key: a lone surrogate", IllegalArgumentException.class, () -> Keys.deriveKey("\ud83d"));
    check.throwsException("derive_key: a double", IllegalArgumentException.class, () -> Keys.deriveKey(1.0));
    check.equal("derive_key: Integer, Long and BigInteger agree", Keys.deriveKey(BigInteger.valueOf(7)), Keys.deriveKey(7L));
    check.equal("derive_key: Integer and Long agree", Keys.deriveKey(7), Keys.deriveKey(7L));
    check.equal("derive_key: the KEYS.md example", "2c9d52482319f98b31533f1dac7ede2a88ab60115bd0d28a6b086143c552e692",
        Keys.deriveKey("evt_1"));
    check.equal("fingerprint: a Java map", Keys.hex(Keys.fingerprint(Map.of("b", 1, "a", List.of(1, 2, 3)))),
        "5bf78e9b6650ca72df266067a6c73fbd9f9a2dab800b942374edc55271b64751");
    check.ok("key vectors checked: " + count, count >= 30);
  }

  /** {"s": text} | {"b": hex} | {"i": decimal} -> String | byte[] | BigInteger. */
  private static Object typedField(JsonObject field) {
    if (field.has("s")) {
      return field.get("s").getAsString();
    }
    if (field.has("b")) {
      return unhex(field.get("b").getAsString());
    }
    return new BigInteger(field.get("i").getAsString());
  }

  /** A JSON tree as Java values: Map, List, String, Boolean, null, BigDecimal for numbers. */
  static Object toJava(JsonElement json) {
    if (json == null || json.isJsonNull()) {
      return null;
    }
    if (json.isJsonObject()) {
      Map<String, Object> map = new LinkedHashMap<>();
      for (Map.Entry<String, JsonElement> entry : json.getAsJsonObject().entrySet()) {
        map.put(entry.getKey(), toJava(entry.getValue()));
      }
      return map;
    }
    if (json.isJsonArray()) {
      List<Object> list = new ArrayList<>();
      for (JsonElement item : (JsonArray) json) {
        list.add(toJava(item));
      }
      return list;
    }
    JsonPrimitive primitive = json.getAsJsonPrimitive();
    if (primitive.isBoolean()) {
      return primitive.getAsBoolean();
    }
    if (primitive.isNumber()) {
      return primitive.getAsBigDecimal();
    }
    return primitive.getAsString();
  }

  static byte[] unhex(String hex) {
    byte[] out = new byte[hex.length() / 2];
    for (int i = 0; i < out.length; i++) {
      out[i] = (byte) Integer.parseInt(hex.substring(2 * i, 2 * i + 2), 16);
    }
    return out;
  }
}
