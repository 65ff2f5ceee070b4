export * from "./dist/src/powertools";
