// The Java half of the cross-language test (test_cross_language_java.py), the
// counterpart of node_side.js: derive the key and fingerprint from the fields
// and payload it is given, run once() with a work that returns `result`
// (stored as compact UTF-8 JSON, as the Python and Node clients store
// results), and print what happened as one JSON line.
//
//   java -cp "$(cat BUILD/classpath)" JavaSide '{"target": "...", "namespace": "...",
//       "fields": [...], "payload": {...}, "result": {...}, "onInProgress": "throw"}'
//
// gson (which grpc-core needs anyway) reads and writes the JSON; the client
// library itself does not use it.
import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonNull;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import com.google.gson.JsonPrimitive;
import idempotency.client.IdempotencyClient;
import idempotency.client.IdempotencyException;
import idempotency.client.Keys;
import idempotency.client.OnceOptions;
import idempotency.client.OnceResult;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

public final class JavaSide {
  private static final Gson GSON = new GsonBuilder().disableHtmlEscaping().serializeNulls().create();

  public static void main(String[] args) {
    JsonObject request = JsonParser.parseString(args[0]).getAsJsonObject();
    JsonObject report = new JsonObject();
    try (IdempotencyClient client = new IdempotencyClient(request.get("target").getAsString())) {
      List<Object> fields = new ArrayList<>();
      for (JsonElement field : request.getAsJsonArray("fields")) {
        fields.add(toJava(field));
      }
      String key = Keys.deriveKey(fields.toArray());
      byte[] fingerprint = Keys.fingerprint(toJava(request.get("payload")));
      report.addProperty("key", key);
      report.addProperty("fingerprint", Keys.hex(fingerprint));
      byte[] result = GSON.toJson(request.get("result")).getBytes(StandardCharsets.UTF_8);
      OnceOptions options = OnceOptions.defaults().waitTimeout(Duration.ofSeconds(5));
      if (request.has("onInProgress") && request.get("onInProgress").getAsString().equals("throw")) {
        options = options.throwOnInProgress();
      }
      boolean[] ran = {false};
      try {
        OnceResult outcome = client.onceWithDetails(request.get("namespace").getAsString(), key, fingerprint, () -> {
          ran[0] = true;
          return result;
        }, options);
        report.addProperty("ran", ran[0]);
        report.addProperty("replayed", outcome.replayed());
        report.add("value", JsonParser.parseString(new String(outcome.value(), StandardCharsets.UTF_8)));
      } catch (IdempotencyException error) {
        report.addProperty("ran", ran[0]);
        report.addProperty("error", error.getClass().getSimpleName());
        report.addProperty("message", error.getMessage());
      }
    }
    System.out.println(GSON.toJson(report));
  }

  /** Strings, integral numbers (as BigInteger), Booleans, null, Maps and Lists. */
  private static Object toJava(JsonElement json) {
    if (json == null || json instanceof JsonNull) {
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
      // Written as an integer: a key field tagged "i", as Python's json.loads gives an int.
      String text = primitive.getAsString();
      return text.matches("-?[0-9]+") ? new BigInteger(text) : new BigDecimal(text);
    }
    return primitive.getAsString();
  }
}
